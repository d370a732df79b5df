"""``scaleout bench``: side-by-side benchmarks (collectives now; training with the testbed)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import tempfile

from scaleout.bench.stats import format_size, parse_sizes
from scaleout.core.checks import check_cuda_asked, check_seconds
from scaleout.table import format_table
from scaleout.launch.launcher import LaunchConfig, launch

EXAMPLE = """example:
  scaleout bench collectives -n 2 --ops allreduce,allgather --sizes 1K..64M --json out.json
"""

# Further `scaleout bench X` subcommands: modules exposing register(subparsers).
_MORE = ("scaleout.cli.bench_train", "scaleout.cli.bench_codecs")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks, scaleout vs its peers side by side")
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    coll = sub.add_parser(
        "collectives", help="scaleout collectives vs plain torch.distributed",
        description="Time each collective through scaleout and through plain torch.distributed "
                    "in the same run, interleaved round by round; report time, algorithm and "
                    "bus bandwidth (nccl-tests convention) and the time ratio ours/torch.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    coll.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (default 2)")
    coll.add_argument("--ops", default="allreduce",
                      help="comma list of allreduce,reduce_scatter,allgather,bcast,reduce,"
                           "alltoall,gather,scatter (default allreduce)")
    coll.add_argument("--sizes", default="1K..64M",
                      help="LOW..HIGH in powers of 4, or a comma list (default 1K..64M)")
    coll.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    coll.add_argument("--budget", type=float, default=0.05,
                      help="seconds of calls per timed block (default 0.05)")
    coll.add_argument("--testbed", default=None, metavar="NAME",
                      help="run one rank per host of an emulated cluster")
    coll.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                      help="buffers on the CPU (CUDA hidden from the ranks) or on each rank's "
                           "GPU (default cpu)")
    coll.add_argument("--json", default=None, metavar="FILE", help="also write results as JSON")
    coll.set_defaults(func=handle_collectives)
    for name in _MORE:
        try:
            importlib.import_module(name).register(sub)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise


def collectives_table(results: dict) -> str:
    rows = []
    for r in results["results"]:
        rows.append([r["op"], format_size(r["bytes"]), f"{r['time_s'] * 1e6:.1f}",
                     f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
                     f"{r['torch_busbw_GBps']:.3f}", f"{r['ratio']:.3f}"])
    headers = ["op", "size", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "torch busbw",
               "ours/torch"]
    return format_table(headers, rows)


def handle_collectives(args: argparse.Namespace) -> int:
    from scaleout.bench.collectives import OPS

    try:
        parse_sizes(args.sizes)
        unknown = [op for op in args.ops.split(",") if op not in OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; choose from {', '.join(OPS)}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        check_seconds(args.budget, "--budget")
        check_cuda_asked(args.device)
        wrapper, master_addr = None, "127.0.0.1"
        if args.testbed is not None:
            from scaleout.testbed import attach_wrapper

            wrapper, master_addr = attach_wrapper(args.testbed, args.nprocs)
        env = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}
        config = LaunchConfig(nprocs=args.nprocs, master_addr=master_addr, env=env)
    except ValueError as err:
        print(f"scaleout bench: error: {err}", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        target = ["-m", "scaleout.bench.collectives", "--ops", args.ops, "--sizes", args.sizes,
                  "--rounds", str(args.rounds), "--budget", str(args.budget),
                  "--device", args.device, "--json", path]
        code = launch(target, config, wrapper=wrapper)
        if code != 0:
            return code
        with open(path) as handle:
            results = json.load(handle)
    from scaleout.bench.provenance import run_facts

    results = {"command": getattr(args, "command_line", ["scaleout", *sys.argv[1:]]),
               "date": started.isoformat(timespec="seconds"), **run_facts(), **results}
    print(f"\n{results['ranks']} ranks, backend {results['backend']}, buffers on "
          f"{results.get('device', 'cpu')}; ours/torch is the median "
          "of per-round time ratios (1.000 = no overhead)")
    print(collectives_table(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0
