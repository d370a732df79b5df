"""``scaleout sim``: predict collectives and training iterations on machines we do not have."""

from __future__ import annotations

import argparse
import json

from scaleout.cli.sim_args import (
    algorithm_from,
    emit,
    fail,
    finite_float,
    json_arg,
    network_args,
    topology_from,
)
from scaleout.cli.sim_run import handle_run, handle_sweep
from scaleout.cli.sim_traces import register_chrome
from scaleout.table import format_table

__all__ = ["register", "handle_collective", "handle_validate"]

EXAMPLE = r"""examples:
  scaleout sim collective --op allreduce --algorithm ring --topology 8 --bandwidth 100Gbps \
      --latency 5us --size 64MB
  scaleout sim collective --topology 8x16 --bandwidth 300GB/s,100Gbps --latency 1us,5us \
      --kind switch --themis --json
  scaleout sim run --model resnet50 --device p100 --batch 32 --preset goyal-bigbasin \
      --chrome it.json
  scaleout sim sweep --model gpt:96 --device h100 --batch 8 --preset dgx-ethernet --nodes 8..4096
  scaleout sim validate --json validation.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``scaleout sim`` and its subcommands to ``subparsers``."""
    parser = subparsers.add_parser(
        "sim",
        help="predict scale-out performance (simulator)",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="sim", metavar="WHAT", required=True)
    coll = sub.add_parser(
        "collective",
        help="price one collective on a topology",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    coll.add_argument(
        "--op",
        default="allreduce",
        help="allreduce, reduce_scatter, allgather, broadcast, alltoall",
    )
    coll.add_argument("--size", default="64MB", help="bytes per NPU (64MB)")
    coll.add_argument(
        "--themis",
        action="store_true",
        help="also run the chunked all-reduce with fixed-order and Themis scheduling (one "
        "algorithm for every dimension, not --flat)",
    )
    coll.add_argument("--chunks", type=int, default=None,
                      help="chunks for --themis (default 64)")
    network_args(coll)
    json_arg(coll)
    coll.set_defaults(func=handle_collective)
    for name, handler, text in (
        ("run", handle_run, "price one training iteration"),
        ("sweep", handle_sweep, "a scaling curve over node counts"),
    ):
        p = sub.add_parser(
            name, help=text, epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        src = p.add_mutually_exclusive_group()
        src.add_argument(
            "--model", default="resnet50", help="a model of the table (resnet50, gpt:96, ...)"
        )
        src.add_argument("--trace", default=None, help="a scaleout-trace JSON of a single-rank run")
        src.add_argument(
            "--chakra", default=None, metavar="FILE", help="one rank's Chakra .et file"
        )
        p.add_argument(
            "--device",
            default=None,
            help="device of the table, or FLOP/s (e.g. 5e12); with --model (default p100)",
        )
        p.add_argument(
            "--batch", type=int, default=None, help="samples per rank (default 32, or the trace's)"
        )
        p.add_argument(
            "--speed",
            type=finite_float,
            default=None,
            help="device speed-up over the trace's; with --trace (default 1)",
        )
        p.add_argument("--policy", default="priority", choices=("fifo", "priority"))
        p.add_argument("--mode", default="overlap", choices=("overlap", "sync"))
        p.add_argument("--bucket", default="8MB", help="bucket bytes (default 8MB)")
        p.add_argument(
            "--codec",
            default="none",
            help="a measured scaleout codec: cast:fp16, blockquant, sign, topk:ratio=0.01, "
            "powersgd:rank=2 (docs/simulator.md); for another codec use --codec-ratio, "
            "--codec-cost and --codec-gather instead",
        )
        p.add_argument(
            "--pipeline",
            choices=("baseline", "themis"),
            default=None,
            help="cut each multi-dimensional all-reduce into chunks pipelined across dimensions, "
            "in fixed order or Themis' order",
        )
        p.add_argument("--pipeline-chunks", type=int, default=16, help="chunks (default 16)")
        p.add_argument(
            "--codec-ratio",
            type=finite_float,
            default=None,
            help="a codec not measured here (not with --codec): wire bytes / gradient bytes "
            "(default 1)",
        )
        p.add_argument(
            "--codec-cost",
            type=finite_float,
            default=None,
            help="that codec's seconds per gradient MB (default 0)",
        )
        p.add_argument(
            "--codec-gather", action="store_true", help="that codec's payloads are all-gathered"
        )
        p.add_argument(
            "--host-cost",
            type=finite_float,
            default=0.0,
            help="CPU seconds per wire MB the host spends moving bytes on the cores its compute "
            "uses (charged while it overlaps compute; 0: offloaded network)",
        )
        p.add_argument(
            "--cycle", default="0s", metavar="TIME",
            help="collectives start only at the cycles of a background loop this far apart, "
            "like Horovod's (HOROVOD_CYCLE_TIME, default 5ms there); 0s (default): at once",
        )
        network_args(p)
        json_arg(p)
        # what a Chakra trace (run as its own graph) does not take: refused when changed
        p.set_defaults(graph_ignores={dest: p.get_default(dest) for dest in (
            "batch", "policy", "mode", "bucket", "codec", "pipeline", "pipeline_chunks",
            "codec_ratio", "codec_cost", "codec_gather", "host_cost", "cycle")})
        if name == "run":
            p.add_argument(
                "--nodes", type=int, default=None, help="resize the topology to this many NPUs"
            )
            p.add_argument("--chrome", default=None, metavar="FILE", help="write a Chrome trace")
            p.add_argument(
                "--ranks",
                type=int,
                default=None,
                help="tracks in the Chrome trace, files of --write-chakra (default 4; at most "
                "the topology's NPUs)",
            )
            p.add_argument(
                "--write-chakra",
                default=None,
                metavar="PREFIX",
                help="write PREFIX.<rank>.et for --ranks ranks",
            )
        else:
            p.add_argument(
                "--nodes", default="1..1024", help="LOW..HIGH in powers of 2, or a comma list"
            )
            p.add_argument("--plot", default=None, metavar="PNG", help="plot (needs matplotlib)")
        p.set_defaults(func=handler)
    val = sub.add_parser(
        "validate",
        help="predicted vs measured; fails above the stated bounds",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    val.add_argument("--only", choices=("published", "testbed", "collectives"), default=None)
    val.add_argument(
        "--json",
        default="sim-validation.json",
        metavar="FILE",
        help="write the results (default sim-validation.json)",
    )
    val.set_defaults(func=handle_validate)
    register_chrome(sub)


def handle_collective(args: argparse.Namespace) -> int:
    """``scaleout sim collective``: price one collective (and Themis' gain); exit code."""
    from scaleout.sim.collectives import collective_cost
    from scaleout.sim.themis import pipelined_algorithm, themis_gain
    from scaleout.sim.units import format_time, parse_bytes

    try:
        topo = topology_from(args)
        size = parse_bytes(args.size)
        cost = collective_cost(
            topo, op=args.op, algorithm=algorithm_from(args), nbytes=size, flat=args.flat
        )
        data = {
            "op": args.op,
            "algorithm": cost.algorithm,
            "topology": topo.describe(),
            "npus": topo.npus,
            "bytes": size,
            "time_s": cost.time,
            "algbw_GBps": cost.algbw / 1e9,
            "busbw_GBps": cost.busbw / 1e9,
            "utilisation": list(cost.utilisation()),
            "phases": [vars(p) for p in cost.phases],
        }
        lines = [
            f"{args.op} of {args.size} on {topo.describe()} ({topo.npus} NPUs), {cost.algorithm}: "
            f"{format_time(cost.time)}, algbw {cost.algbw / 1e9:.3f} GB/s, "
            f"busbw {cost.busbw / 1e9:.3f} GB/s",
            format_table(
                ["dim", "phase", "start", "end", "bytes in", "link util"],
                [
                    [
                        p.dim,
                        p.op,
                        format_time(p.start),
                        format_time(p.end),
                        int(p.nbytes),
                        f"{cost.utilisation()[p.dim]:.2f}",
                    ]
                    for p in cost.phases
                ],
            ),
        ]
        if args.chunks is not None and not args.themis:
            raise ValueError("--chunks applies to --themis (one collective is not chunked)")
        if args.themis:
            if args.op != "allreduce":
                raise ValueError("--themis schedules all-reduce only")
            args.chunks = 64 if args.chunks is None else args.chunks
            gain, base, them = themis_gain(
                topo,
                nbytes=size,
                chunks=args.chunks,
                algorithm=pipelined_algorithm(algorithm_from(args), args.flat),
            )
            data["themis"] = {
                "chunks": args.chunks,
                "baseline_s": base.time,
                "themis_s": them.time,
                "gain": gain,
                "baseline_utilisation": list(base.utilisation()),
                "themis_utilisation": list(them.utilisation()),
            }
            lines.append(
                f"chunked x{args.chunks}: fixed order {format_time(base.time)}, Themis "
                f"{format_time(them.time)}: gain {gain:.2f}x; link utilisation "
                f"{[round(u, 2) for u in base.utilisation()]} -> "
                f"{[round(u, 2) for u in them.utilisation()]}"
            )
    except (ValueError, TypeError) as err:
        return fail(err)
    return emit(args, data, "\n".join(lines))


def handle_validate(args: argparse.Namespace) -> int:
    """``scaleout sim validate``: the table, the JSON; 1 when a bound is exceeded."""
    from scaleout.sim.collective_cases import collective_scenarios
    from scaleout.sim.published import published_scenarios
    from scaleout.sim.testbed_cases import testbed_scenarios
    from scaleout.sim.validation import validate

    scenarios = []
    if args.only in (None, "published"):
        scenarios += published_scenarios()
    if args.only in (None, "testbed"):
        scenarios += testbed_scenarios()
    if args.only in (None, "collectives"):
        scenarios += collective_scenarios()
    report = validate(scenarios)
    print(
        format_table(
            ["scenario", "measured", "predicted", "error", "bound", "", "source"], report.rows()
        )
    )
    for line in report.summaries:
        print(line)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({**report.as_dict(), "command": args.command_line}, f, indent=1)
    print(f"wrote {args.json}; {'all bounds met' if report.ok else 'FAILED: a bound is exceeded'}")
    return 0 if report.ok else 1
