"""``scaleout sim chrome``: one Chrome / Perfetto trace of a real run's recorded traces."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

from scaleout.cli.sim_args import fail

__all__ = ["register_chrome", "handle_chrome"]


def register_chrome(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chrome",
        help="merge a run's recorded traces (trace.<rank>.json) into one Chrome trace",
        epilog="example:\n  SCALEOUT_TRACE=traces scaleout run -n 2 train.py\n"
               "  scaleout sim chrome traces -o run.json   # open in ui.perfetto.dev\n"
               "  scaleout sim run --trace traces/trace.0.json --nodes 64 --preset ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", help="the folder given to DataParallel(trace=) / SCALEOUT_TRACE")
    p.add_argument("-o", "--output", default=None, help="output file (default FOLDER/chrome.json)")
    p.add_argument("--model", type=int, default=0, metavar="N",
                   help="which traced model of each process: 0 (default) reads "
                        "trace.<rank>.json, N > 0 trace.<rank>.N.json (a process that trains "
                        "several DataParallel models writes one file per model)")
    p.set_defaults(func=handle_chrome)


def _files_by_rank(folder: str, model: int) -> dict[int, str]:
    """rank -> the file of traced model ``model`` in ``folder`` (``trace.<rank>.json`` for
    model 0, ``trace.<rank>.<model>.json`` after: ``scaleout.session.trace.trace_path``)."""
    by_rank = {}
    for path in glob.glob(os.path.join(folder, "trace.*.json")):
        match = re.search(r"trace\.(\d+)(?:\.(\d+))?\.json$", path)
        if match and int(match.group(2) or 0) == model:
            by_rank[int(match.group(1))] = path
    return by_rank


def handle_chrome(args: argparse.Namespace) -> int:
    """Write the merged trace; exit code."""
    from scaleout.sim.chrome import chrome_trace_of_ranks, recorded_spans

    if args.model < 0:
        return fail(ValueError(f"--model must be >= 0, got {args.model}"))
    by_rank = _files_by_rank(args.folder, args.model)
    if not by_rank:
        name = "trace.<rank>.json" if args.model == 0 else f"trace.<rank>.{args.model}.json"
        return fail(ValueError(f"no {name} in {args.folder!r}: record with "
                               "DataParallel(trace=FOLDER) or SCALEOUT_TRACE=FOLDER"))
    try:
        per_rank = []
        for rank in range(max(by_rank) + 1):
            if rank not in by_rank:
                raise ValueError(f"rank {rank}'s trace is missing from {args.folder!r}")
            try:
                with open(by_rank[rank], encoding="utf-8") as f:
                    per_rank.append(recorded_spans(json.load(f)))
            except ValueError as err:  # (names the file, not only the event)
                raise ValueError(f"{by_rank[rank]}: not a scaleout trace: {err}") from None
    except (OSError, ValueError) as err:
        return fail(err)
    output = args.output or os.path.join(args.folder, "chrome.json")
    with open(output, "w", encoding="utf-8") as f:
        json.dump(chrome_trace_of_ranks(per_rank), f)
    print(f"wrote {output}: {len(per_rank)} ranks, "
          f"{sum(len(s) for s in per_rank)} spans")
    return 0
