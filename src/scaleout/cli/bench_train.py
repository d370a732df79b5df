"""``scaleout bench train``: train a workload with scaleout and its peers, side by side."""

from __future__ import annotations

import argparse
import datetime
import contextlib
import json
import signal
import sys

from scaleout.launch.allocator import ALLOCATORS, DEFAULT_ALLOCATOR
from scaleout.launch.stop_signals import raise_on_stop

EXAMPLE = """examples:
  scaleout bench train --workload resnet18 --ranks 2 --rate 1gbit --vs ddp,ddp-fp16 --rounds 3
  scaleout bench train --workload digits-mlp --rounds 1 --iters 3 --warmup 1 --no-testbed
  scaleout bench train --workload dlrm --parallel hybrid --vs ddp --memory-budget 4m
  scaleout bench train --workload digits-cnn --vs ddp,ddp-powersgd,zero --compression powersgd:2 \\
      --json out.json --plot out.png

  scaleout bench train --workload resnet18 --device cuda --no-testbed --vs ddp,ddp-powersgd
  scaleout bench train --workload resnet18 --rounds 1 --trace traces   # then:
      scaleout sim chrome traces/scaleout/round0

Every round runs each configuration once, in a rotated order; each configuration's ranks
start once and stay warm (idle) between its turns, all started before round 0 (--cold:
fresh ranks every round):
  single    one rank alone on host 0 (the ideal), same per-rank batch
  scaleout  DataParallel + DistributedOptimizer(SGD momentum 0.9)
  --vs      ddp, ddp-fp16 (fp16_compress_hook), ddp-powersgd (powerSGD_hook, rank 2,
            from iteration 2), zero (DDP + ZeroRedundancyOptimizer), scaleout-sharded
            (scaleout with distributed_update=True, exact: zero's peer), and two ceilings
            that are not trainers: lockstep (ranks compute alone and meet once per
            iteration: the best any synchronous data-parallel run can do here) and
            lockstep-traffic (that, plus the exact gradients' bytes in flight, hidden
            behind a whole iteration); hybrid (DLRM: tables sharded across the ranks,
            dense MLPs data parallel, the next batch's ids and rows prefetched; also
            --parallel hybrid), hybrid-deferred (the same, the rows' gradients sent
            back without blocking backward), hybrid-noprefetch (without prefetching),
            hybrid-unfused (the tables stepped after backward, not updated in it),
            hybrid-one-round (each batch's ids alone when prefetched, not with the rows'
            gradients of the batch before), hybrid-two-rounds (and its id counts and ids
            as two exchanges);
            hybrid-lockstep (hybrid's ceiling: each rank runs hybrid's compute alone on
            all the tables and meets the others once per iteration)
The testbed (one network namespace per rank, links shaped to --rate) needs root, ip and
tc; --no-testbed runs over loopback instead, with no rate limit. A configuration that
fails is reported with its reason and not run again; the others go on (exit code 1).
Each round times one lead-in iteration more than --iters, recorded but not counted.
After every round each rank digests its parameters: a trainer whose ranks disagree, or
an exact one (scaleout, ddp, ddp-tuned, zero, scaleout-sharded, hybrid) that differs
from ddp, is reported in a WRONG: line (exit code 1); lossy ones get their distance.
"""


# (written out: the registry imports torch, and --help should not)
WORKLOADS_HELP = "resnet18, resnet50, transformer, dlrm, dlrm-large, digits-mlp or digits-cnn"


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--workload``, ``--ranks`` and ``--rate``: what trains, on how many hosts, how linked
    (``bench train`` and ``tune``)."""
    parser.add_argument("--workload", required=True,
                        help=WORKLOADS_HELP)
    parser.add_argument("--ranks", type=int, default=2, help="ranks, one per host (default 2)")
    parser.add_argument("--rate", default=None,
                        help="link rate per direction of each testbed host (default 1gbit; not "
                             "with --no-testbed, whose loopback has no rate limit)")


def cluster_rate(args: argparse.Namespace) -> str:
    """``--rate``, or its default.

    Raises:
        ValueError: ``--rate`` with ``--no-testbed`` (loopback shapes nothing).
    """
    if args.rate is None:
        return "1gbit"
    if args.no_testbed:
        raise ValueError("--rate shapes the testbed's links, and --no-testbed runs over loopback "
                         "with no rate limit: give one or the other")
    return args.rate


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``scaleout bench`` subcommands."""
    from scaleout.bench.train_peers import PEERS

    parser = subparsers.add_parser(
        "train", help="training throughput: scaleout vs DDP (and friends) on an emulated network",
        description="Train one workload with a single rank, with scaleout and with each peer, "
                    "interleaved round by round on the same emulated cluster, same seeds and "
                    "data; report throughput, scaling efficiency and scaleout/peer ratios.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser)
    parser.add_argument("--vs", default="ddp",
                        help=f"comma list of peers from {','.join(PEERS)} or ddp-tuned:MB (default ddp)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--iters", type=int, default=10,
                        help="timed iterations per run (default 10)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed iterations before them (default 2; 16 with "
                             "--compression auto, which tunes and checks its choice during "
                             "them; 10, the least it takes; at least 2 with ddp-powersgd); "
                             "then one lead-in iteration, timed but not counted")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per rank (default: the workload's)")
    parser.add_argument("--compression", action="append", default=None, metavar="SPEC",
                        help="a scaleout variant with this gradient codec, e.g. cast:bf16, "
                             "powersgd:2, topk:ratio=0.01; repeat for several variants in the "
                             "same run; 'none' is exact gradients, 'auto' lets scaleout tune "
                             "itself (scheduling and codecs) during the warm-up, 'auto-exact' "
                             "scheduling only (default: only 'none')")
    parser.add_argument("--policy", default="default", choices=("default", "priority", "fifo"),
                        help="scaleout's scheduling policy (default: scaleout's, which is "
                             "priority, but fifo for CUDA tensors over gloo)")
    parser.add_argument("--mode", default="overlap", choices=("overlap", "sync"),
                        help="scaleout's DistributedOptimizer mode (default overlap)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (default 1: fair on small machines)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--allocator", default=DEFAULT_ALLOCATOR, choices=ALLOCATORS,
                        help="every configuration's ranks get these host allocator settings "
                             "(as scaleout run --allocator; default keep)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                        help="ranks give up on a rendezvous or collective after this (default 300)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write settings, machine, summary and every raw run as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="write a bar chart (needs matplotlib)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="train on the CPU (CUDA hidden from the ranks) or on CUDA, rank r "
                             "on GPU r %% GPUs (default cpu)")
    parser.add_argument("--parallel", default="data", choices=("data", "hybrid"),
                        help="hybrid: also run the 'hybrid' peer (DLRM: tables sharded across "
                             "the ranks, dense MLPs data parallel); default data")
    parser.add_argument("--memory-budget", default=None, metavar="BYTES",
                        help="parameter bytes one rank may hold (suffixes k, m, g: powers of "
                             "1024): hybrid plans its tables under it, every configuration "
                             "reports whether it fits")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="record per-rank traces of every run that trains with scaleout's "
                             "DataParallel into DIR/<configuration>/round<r>/trace.<rank>.json "
                             "(scaleout sim chrome / sim run --trace read them)")
    parser.add_argument("--cold", action="store_true",
                        help="fresh ranks for every configuration and round (default: each "
                             "configuration's ranks stay warm from round to round; --trace "
                             "always runs cold)")
    parser.add_argument("--no-testbed", action="store_true",
                        help="run over loopback without namespaces or shaping (no root needed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=handler)


def _terminate_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGTERM, SIGHUP (``kill``, a job scheduler, a closed terminal) stop the run like
    Ctrl-C: ranks stopped, testbed removed. The first signal raises ``Interrupted``; later
    ones, and any while an interrupt unwinds (while ranks run, the launcher takes the signal,
    stops the ranks and the benchmark raises ``Interrupted`` itself), are ignored so that
    they cannot cut the clean-up short. A signal this process ignores stays ignored, as in
    the launcher (``nohup``: SIGHUP). Only in the main thread, where Python can take
    signals."""
    from scaleout.bench.train import Interrupted

    return raise_on_stop(Interrupted)


def _memory_budget(text: str) -> int:
    """``--memory-budget``'s bytes (``64m``, ``1.5G``, ``1048576``: binary prefixes)."""
    from scaleout.sim.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise ValueError(f"--memory-budget: {err}") from None


def _error(message: str) -> int:
    print(f"scaleout bench train: error: {message}", file=sys.stderr)
    return 2


def _warmup(args: argparse.Namespace, peers: tuple[str, ...]) -> int:
    """``--warmup``, or its default: 2, or :data:`AUTO_WARMUP_DEFAULT` when a variant tunes
    itself (``auto``); raised to ``POWERSGD_START`` (and said on stderr) with
    ``ddp-powersgd``, whose iterations before that are plain allreduce."""
    from scaleout.bench.train_config import AUTO_WARMUP_DEFAULT
    from scaleout.bench.train_peers import POWERSGD_START

    if args.warmup is None:
        return AUTO_WARMUP_DEFAULT if {"auto", "auto-exact"} & set(args.compression or ()) else 2
    if "ddp-powersgd" in peers and 0 <= args.warmup < POWERSGD_START:
        print(f"scaleout bench train: --warmup {args.warmup} raised to {POWERSGD_START}: "
              f"ddp-powersgd compresses from iteration {POWERSGD_START} (plain allreduce "
              "before), and every configuration takes the same warm-up", file=sys.stderr)
        return POWERSGD_START
    return args.warmup


def handler(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write ``--json`` / ``--plot``; the exit code."""
    from scaleout.bench.train import TrainBenchConfig, run_benchmark
    from scaleout.bench.train_report import build_report, format_report, machine_facts
    from scaleout.testbed import TestbedError, TestbedUnavailable, check_capabilities

    peers = tuple(p.strip() for p in args.vs.split(",") if p.strip())
    if getattr(args, "parallel", "data") == "hybrid" and "hybrid" not in peers:
        peers = (*peers, "hybrid")
    try:
        budget = (_memory_budget(args.memory_budget) if getattr(args, "memory_budget", None)
                  else None)
        config = TrainBenchConfig(
            workload=args.workload, ranks=args.ranks, rate=cluster_rate(args), peers=peers,
            memory_budget=budget,
            rounds=args.rounds, iters=args.iters, warmup=_warmup(args, peers), batch=args.batch,
            compression=tuple(args.compression or ["none"]), policy=args.policy, mode=args.mode,
            threads=args.threads, seed=args.seed, testbed=not args.no_testbed,
            timeout_s=args.timeout, device=args.device, trace=getattr(args, "trace", None),
            warm=not getattr(args, "cold", False), allocator=args.allocator)
    except (ValueError, TypeError) as err:
        return _error(str(err))
    if args.plot:  # fail before the run, not after it
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return _error("--plot needs matplotlib, which is not installed: pip install "
                          "matplotlib  (or drop --plot)")
    if config.testbed:
        try:
            check_capabilities()
        except TestbedUnavailable as err:
            return _error(f"{err}; or pass --no-testbed to run over loopback (no rate limit)")
    started = datetime.datetime.now(datetime.timezone.utc)
    before = machine_facts()
    try:
        with _terminate_as_interrupt():
            raw = run_benchmark(config, progress=not args.no_progress)
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"scaleout bench train: interrupted ({signal.Signals(signum).name}); ranks "
              "stopped and testbed removed", file=sys.stderr)
        return 128 + signum
    except TestbedError as err:
        return _error(f"the testbed failed: {err}")
    command = getattr(args, "command_line", ["scaleout", *sys.argv[1:]])
    report = build_report(raw, argv=command, started=started, machine_before=before)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    if args.plot:
        from scaleout.bench.train_report import plot_report

        plot_report(report, args.plot)
    failed = sorted({run["config"] for run in raw["runs"] if "error" in run})
    if failed:
        print(f"scaleout bench train: {len(failed)} configuration(s) failed: {', '.join(failed)} "
              "(their output is in the JSON's runs)", file=sys.stderr)
    wrong = [name for name, entry in report["summary"].items()
             if (entry.get("check") or {}).get("wrong")]
    if wrong:
        print(f"scaleout bench train: {len(wrong)} configuration(s) trained wrong: "
              f"{', '.join(wrong)} (the WRONG lines above; the JSON's checks)", file=sys.stderr)
    return 1 if failed or wrong else 0
