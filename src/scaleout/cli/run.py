"""``scaleout run``: start ranks of a training script (torchrun-compatible variables)."""

from __future__ import annotations

import argparse
import os
import sys

from scaleout.launch.allocator import ALLOCATORS, DEFAULT_ALLOCATOR
from scaleout.launch.launcher import LaunchConfig, launch

EXAMPLE = """examples:
  scaleout run -n 2 examples/train_digits.py --epochs 5
  scaleout run -n 2 -m scaleout.bench.collectives --sizes 1M --json /tmp/c.json
  # restart every rank after a failure, up to 3 times (the script resumes from its checkpoint):
  scaleout run -n 2 --max-restarts 3 train.py --checkpoint ckpt/run
  # two nodes (run on each, node-rank 0 and 1):
  scaleout run -n 4 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py
"""


DESCRIPTION = """\
Start N ranks of a training script (or -m module) with torchrun's variables set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); when one rank fails,
the others are stopped. With --max-restarts K, every rank is then started again
(up to K times, fresh rendezvous, SCALEOUT_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT
say which attempt it is); the script resumes from its last checkpoint. Each rank's
C library keeps the memory it frees for reuse (--allocator keep; GLIBC_TUNABLES)
instead of faulting it in again every iteration."""

# run's own options that take a value; everything from the script (or -m) on is the target's
_VALUED = {"-n", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
           "--testbed", "--max-restarts", "--allocator", "--linger"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``scaleout run`` arguments into run's own and the target's.

    The target starts at ``--``, at ``-m``, or at the first word that is not an option of
    run (or an option's value), so ``scaleout run -n 2 -m pkg.mod --flag`` passes ``--flag``
    to the module.
    """
    index = 0
    while index < len(argv):
        word = argv[index]
        if word in ("--", "-m") or not word.startswith("-"):
            return argv[:index], argv[index:]
        if word in _VALUED:
            index += 1
        index += 1
    return argv, []


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="start N ranks of a script", description=DESCRIPTION, epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)  # (split_argv knows whole names: --nproc's value was the script)
    parser.add_argument("-n", "--nproc-per-node", type=int, default=2, dest="nprocs",
                        help="ranks on this node (default 2)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default: a free port; required with --nnodes > 1)")
    parser.add_argument("--testbed", default=None, metavar="NAME",
                        help="run one rank per host of the emulated cluster NAME (-n at "
                             "most its hosts; see: scaleout testbed up --help)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="after a failure, start every rank again up to K times "
                             "(default 0; single node only)")
    parser.add_argument("--linger", type=float, default=None, metavar="S",
                        help="after the first rank exits with 0, stop the ranks still "
                             "running S seconds later and fail the job (a hang at "
                             "teardown); default: wait for them")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=DEFAULT_ALLOCATOR,
                        help="keep (default): each rank's glibc reuses the memory it frees "
                             "instead of returning it to the kernel and faulting it in again "
                             "next iteration (GLIBC_TUNABLES; tunables already set there win); "
                             "system: glibc's defaults")
    parser.add_argument("target", nargs=argparse.REMAINDER,
                        help="script.py [args] or -m module [args]")
    parser.set_defaults(func=handler)


#: what every rank reads at init: checked here when set
_SETTINGS = ("SCALEOUT_CHECK", "SCALEOUT_HEARTBEAT", "SCALEOUT_BACKEND")


def handler(args: argparse.Namespace) -> int:
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    try:
        if any(os.environ.get(name) for name in _SETTINGS):  # (else no torch import here)
            from scaleout.core.env import check_settings

            check_settings(os.environ)  # (each rank would raise the same, in a traceback)
        wrapper = None
        master_addr = args.master_addr
        if args.testbed is not None:
            from scaleout.testbed import attach_wrapper

            wrapper, master_addr = attach_wrapper(args.testbed, args.nprocs, nnodes=args.nnodes,
                                                  node_rank=args.node_rank)
        config = LaunchConfig(nprocs=args.nprocs, nnodes=args.nnodes, node_rank=args.node_rank,
                              master_addr=master_addr, master_port=args.master_port,
                              prefix_output=not args.no_prefix,
                              max_restarts=args.max_restarts, allocator=args.allocator,
                              linger=args.linger, testbed=args.testbed)
        return launch(target, config, wrapper=wrapper)
    except ValueError as err:
        print(f"scaleout run: error: {err}", file=sys.stderr)
        return 2
