"""``scaleout bench codecs``: every codec's encode + decode time against one copy of the same
bytes, beside torch's own DDP hooks (fp16, PowerSGD) on the same tensors."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

EXAMPLE = """examples:
  scaleout bench codecs --device cuda --sizes 1M,25M --json codecs.json
  scaleout bench codecs --sizes 64K --codecs cast:fp16,powersgd:rank=2 --repeats 3

Sizes count fp32 values (25M = 26,214,400), viewed as the most nearly square matrix.
'x copy' is a time over that of one device-to-device copy of the same fp32 bytes (the
memory-bandwidth limit); 'exchange' is the codec's whole exchange on a process group of two
ranks (this process and a peer it starts, over loopback: gloo, or NCCL with the peer on
another GPU; one rank with --ranks 1 or a single GPU, which the header says), 'wire' a
dense all-reduce's wire bytes over the exchange's, 'torch' torch's hook on the same tensor
and group (fp16_compress_hook for cast:fp16, powerSGD_hook for powersgd); 'host syncs'
(CUDA) counts the times one encode + decode / one exchange made the host wait for the GPU.
On the CPU, CUDA is hidden from this process and its peer (torch's PowerSGD hook would call
torch.cuda.synchronize() on CPU tensors).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``codecs`` to the ``scaleout bench`` subcommands."""
    from scaleout.bench.codecs import DEFAULT_CODECS

    parser = subparsers.add_parser(
        "codecs", help="codec encode+decode time vs a copy, beside torch's DDP hooks",
        description="Time every gradient codec (encode + decode, and its whole exchange on "
                    "two ranks) on one device, as multiples of a device-to-device copy of "
                    "the same bytes, beside torch's fp16 and PowerSGD hooks.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--sizes", default="1M,25M",
                        help="fp32 values per tensor, comma list (default 1M,25M)")
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                        help="codec specs separated by ';' or ',' between codecs "
                             f"(default {','.join(DEFAULT_CODECS)})")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, median (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2),
                        help="ranks of the exchange's process group (default 2: a peer "
                             "process over loopback; 1 moves nothing)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write results as JSON")
    parser.set_defaults(func=handler)


def split_codecs(text: str) -> tuple[str, ...]:
    """``"cast:fp16,topk:ratio=0.01,momentum=0.9,sign"`` -> one spec per codec: a
    ``key=value`` item after a comma belongs to the codec before it (``;`` always splits)."""
    from scaleout.compression import CODECS

    specs: list[str] = []
    for chunk in text.replace(";", ",;").split(","):
        item = chunk.lstrip(";").strip()
        if not item:
            continue
        if specs and not chunk.startswith(";") and item.split(":")[0].lower() not in CODECS:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return tuple(specs)


def codecs_table(report: dict) -> str:
    """The results as a readable table."""
    from scaleout.table import format_table

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.3f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    rows = []
    for r in report["results"]:
        if "error" in r:
            rows.append([r["codec"], str(r["numel"]), "failed: " + r["error"][:60],
                         *([""] * 8)])
            continue
        wire = r.get("wire_ratio")
        rows.append([r["codec"], str(r["numel"]), ms(r["encode_decode_s"]),
                     times(r["encode_decode_x_copy"]), ms(r["exchange_s"]), times(r["exchange_x_copy"]),
                     "-" if wire is None else f"{wire:.1f}x",
                     r.get("torch_hook", "-"), ms(r.get("torch_s")),
                     "-" if "ours_over_torch" not in r else f"{r['ours_over_torch']:.2f}",
                     f"{r['host_syncs']}/{r['exchange_host_syncs']}" if "host_syncs" in r else "-"])
    headers = ["codec", "values", "enc+dec ms", "x copy", "exchange ms", "x copy", "wire",
               "torch hook", "torch ms", "ours/torch", "host syncs"]
    return format_table(headers, rows)


@contextlib.contextmanager
def hide_cuda(enabled: bool) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=`` for the duration (restored after), when ``enabled``.

    torch's PowerSGD hook calls ``torch.cuda.synchronize()`` whenever CUDA is available,
    which fails on CPU tensors. Hiding CUDA works while this process has not initialised
    the CUDA runtime (``scaleout`` never does for CPU work); if it has, that hook's row
    reports the error and the other rows are still measured.
    """
    if not enabled:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def handler(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write ``--json``; the exit code."""
    with hide_cuda(args.device == "cpu"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import datetime

    import torch

    from scaleout.bench.codecs import CodecBenchConfig, run_codec_bench
    from scaleout.bench.provenance import run_facts
    from scaleout.bench.stats import parse_sizes

    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        config = CodecBenchConfig(device=args.device, sizes=tuple(parse_sizes(args.sizes)),
                                  codecs=split_codecs(args.codecs), repeats=args.repeats,
                                  warmup=args.warmup, ranks=getattr(args, "ranks", 2))
    except ValueError as err:
        print(f"scaleout bench codecs: error: {err}", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    report = run_codec_bench(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    report["command"] = getattr(args, "command_line", ["scaleout", *sys.argv[1:]])
    report.update(date=started.isoformat(timespec="seconds"), **run_facts())
    alone = report["exchange_alone"]
    where = (f"exchanges on {report['exchange_ranks']} ranks ({report['exchange_backend']})"
             if alone is None else f"exchanges at WORLD SIZE 1 ({alone}): nothing moves, and a "
             "codec may skip work training does")
    print(f"\n{report['device_name']} ({report['device']}), torch {report['torch']}, "
          f"{report['threads']} CPU threads; medians of {config.repeats} runs; {where}")
    print(codecs_table(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 1 if any("error" in r for r in report["results"]) else 0
