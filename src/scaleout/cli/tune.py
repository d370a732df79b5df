"""``scaleout tune``: let DataParallel tune itself on a workload and print what it chose."""

from __future__ import annotations

import argparse
import json
import sys

from scaleout.bench.train_config import AUTO_WARMUP, AUTO_WARMUP_DEFAULT
from scaleout.cli.bench_train import add_cluster_arguments, cluster_rate

EXAMPLE = """examples:
  scaleout tune --workload resnet18 --rate 100mbit          # 2 testbed hosts at 100 Mbit/s
  scaleout tune --workload transformer --ranks 4 --rate 1gbit --exact
  scaleout tune --workload digits-mlp --no-testbed           # loopback (no --rate): nothing lossy

It starts the ranks of `scaleout bench train` with DataParallel(tune=...) (SGD, momentum 0.9),
runs --warmup iterations (the tuner measures the defaults from the second on, measures the
link and the codecs, chooses, and times its choice, and a close runner-up, against the
defaults, keeping the fastest: of 10 warm-up iterations 1 measures and 2 time each trial, of
the default 16, 3 and 4), then --iters timed iterations on the plan kept, and
prints the choice, why, the predicted time of the best candidates and the measured one.
The testbed (one network namespace per rank, links shaped to --rate) needs root, ip and tc.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tune`` to the ``scaleout`` subcommands."""
    parser = subparsers.add_parser(
        "tune", help="tune scheduling (and codecs) for a workload and a network",
        description="Run a short training of a workload whose DataParallel tunes itself "
                    "(bucket and chunk sizes, credit, policy and, unless --exact, a codec per "
                    "layer) and print what it chose and why.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser)
    parser.add_argument("--exact", action="store_true",
                        help="exact gradients only (default: lossy codecs allowed, as with "
                             "bench train --compression auto)")
    parser.add_argument("--warmup", type=int, default=AUTO_WARMUP_DEFAULT,
                        help=f"iterations before the timed ones (>= {AUTO_WARMUP}; default "
                             f"{AUTO_WARMUP_DEFAULT}): the tuner measures and checks its "
                             "choice during them")
    parser.add_argument("--iters", type=int, default=3,
                        help="timed iterations on the chosen plan (default 3)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per rank (default: the workload's)")
    parser.add_argument("--mode", default="overlap", choices=("overlap", "sync"),
                        help="DistributedOptimizer mode (default overlap)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-testbed", action="store_true",
                        help="loopback instead of a testbed (no rate limit)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the choice and the run as JSON")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    """Run the tuning, print the report; the exit code."""
    from scaleout.bench.train import BenchFailed, TrainBenchConfig, run_configuration, variant_name
    from scaleout.testbed import TestbedError, TestbedUnavailable

    spec = "auto-exact" if args.exact else "auto"
    try:
        config = TrainBenchConfig(
            workload=args.workload, ranks=args.ranks, rate=cluster_rate(args), rounds=1,
            iters=args.iters, warmup=args.warmup, batch=args.batch,
            compression=(spec,), mode=args.mode, threads=args.threads, device=args.device,
            testbed=not args.no_testbed)
    except (ValueError, TypeError) as err:
        print(f"scaleout tune: {err}", file=sys.stderr)
        return 2
    if config.ranks < 2:
        print("scaleout tune: --ranks must be >= 2 (one rank has nothing to tune)",
              file=sys.stderr)
        return 2
    try:
        result = run_configuration(config, variant_name(spec))
    except (TestbedUnavailable, TestbedError) as err:
        print(f"scaleout tune: no testbed here ({err}); use --no-testbed", file=sys.stderr)
        return 1
    except BenchFailed as err:
        print(f"scaleout tune: {err}", file=sys.stderr)
        return 1
    tuning = result["details"].get("tuning")
    print(f"{args.workload}, {config.ranks} ranks, {result['network']['description']}")
    print(tuning["summary"])
    print(f"measured after tuning: {result['median_iter_s'] * 1e3:.1f} ms/it (median of "
          f"{len(result['iter_s'])}; predicted {tuning['predicted_s'] * 1e3:.1f} ms/it)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": getattr(args, "command_line", None), "tuning": tuning,
                       "run": result}, handle, indent=1)
    return 0
