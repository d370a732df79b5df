"""``scaleout sim``: predict collectives and training iterations on machines we do not have."""

from __future__ import annotations

import argparse
import json
import sys
import time

from scaleout.table import format_table

EXAMPLE = """examples:
  scaleout sim collective --op allreduce --algorithm ring --topology 8 --bandwidth 100Gbps --latency 5us --size 64MB
  scaleout sim collective --topology 8x16 --bandwidth 300GB/s,100Gbps --latency 1us,5us --kind switch --themis --json
  scaleout sim run --model resnet50 --device p100 --batch 32 --preset goyal-bigbasin --chrome it.json
  scaleout sim sweep --model gpt:96 --device h100 --batch 8 --preset dgx-ethernet --nodes 8..4096
  scaleout sim validate --json validation.json
"""


def _network_args(p: argparse.ArgumentParser, default_topology: str | None = "8") -> None:
    p.add_argument("--preset", default=None, help="a named cluster (see docs/simulator.md)")
    p.add_argument("--topology", default=default_topology,
                   help="NPUs per dimension, innermost first, e.g. 8 or 8x128")
    p.add_argument("--bandwidth", default="100Gbps", help="per dimension, comma separated (100Gbps, 300GB/s)")
    p.add_argument("--latency", default="5us", help="per dimension, comma separated (default 5us)")
    p.add_argument("--kind", default="ring", help="ring, fully_connected or switch, per dimension")
    p.add_argument("--algorithm", default="ring",
                   help="ring, direct, halving_doubling or double_binary_tree (one, or one per dimension)")
    p.add_argument("--flat", action="store_true", help="one ring over all NPUs instead of hierarchical")


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print JSON (or write it to FILE)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sim", help="predict scale-out performance (simulator)",
                                   epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sim", metavar="WHAT", required=True)
    coll = sub.add_parser("collective", help="price one collective on a topology", epilog=EXAMPLE,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    coll.add_argument("--op", default="allreduce", help="allreduce, reduce_scatter, allgather, broadcast, alltoall")
    coll.add_argument("--size", default="64MB", help="bytes per NPU (64MB)")
    coll.add_argument("--themis", action="store_true",
                      help="also run the chunked all-reduce with fixed-order and Themis scheduling")
    coll.add_argument("--chunks", type=int, default=64, help="chunks for --themis (default 64)")
    _network_args(coll)
    _json_arg(coll)
    coll.set_defaults(func=handle_collective)
    for name, handler, text in (("run", handle_run, "price one training iteration"),
                                ("sweep", handle_sweep, "a scaling curve over node counts")):
        p = sub.add_parser(name, help=text, epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
        src = p.add_mutually_exclusive_group()
        src.add_argument("--model", default="resnet50", help="a model of the table (resnet50, gpt:96, ...)")
        src.add_argument("--trace", default=None, help="a scaleout-trace JSON of a single-rank run")
        src.add_argument("--chakra", default=None, metavar="FILE", help="one rank's Chakra .et file")
        p.add_argument("--device", default="p100", help="device of the table, or FLOP/s (e.g. 5e12)")
        p.add_argument("--batch", type=int, default=None, help="samples per rank (default 32, or the trace's)")
        p.add_argument("--speed", type=float, default=1.0, help="device speed-up over the trace's")
        p.add_argument("--policy", default="priority", choices=("fifo", "priority"))
        p.add_argument("--mode", default="overlap", choices=("overlap", "sync"))
        p.add_argument("--bucket", default="8MB", help="bucket bytes (default 8MB)")
        p.add_argument("--codec-ratio", type=float, default=1.0, help="wire bytes / gradient bytes")
        p.add_argument("--codec-cost", type=float, default=0.0, help="codec seconds per gradient MB")
        p.add_argument("--codec-gather", action="store_true", help="codec payloads are all-gathered")
        _network_args(p, default_topology=None)
        _json_arg(p)
        if name == "run":
            p.add_argument("--nodes", type=int, default=None, help="resize the topology to this many NPUs")
            p.add_argument("--chrome", default=None, metavar="FILE", help="write a Chrome trace")
            p.add_argument("--ranks", type=int, default=4, help="tracks in the Chrome trace (default 4)")
            p.add_argument("--write-chakra", default=None, metavar="PREFIX",
                           help="write PREFIX.<rank>.et for --ranks ranks")
        else:
            p.add_argument("--nodes", default="1..1024", help="LOW..HIGH in powers of 2, or a comma list")
            p.add_argument("--plot", default=None, metavar="PNG", help="plot (needs matplotlib)")
        p.set_defaults(func=handler)
    val = sub.add_parser("validate", help="predicted vs measured; fails above the stated bounds",
                         epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    val.add_argument("--only", choices=("published", "testbed"), default=None)
    val.add_argument("--json", default="sim-validation.json", metavar="FILE",
                     help="write the results (default sim-validation.json)")
    val.set_defaults(func=handle_validate)


def _emit(args: argparse.Namespace, data: dict, text: str) -> None:
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")


def _topology(args: argparse.Namespace):
    from scaleout.sim.network import parse_topology, preset

    if args.preset:
        return preset(args.preset).topology
    split = lambda text: [x.strip() for x in text.split(",")]  # noqa: E731
    return parse_topology(args.topology or "8", bandwidths=split(args.bandwidth),
                          latencies=split(args.latency), kinds=split(args.kind))


def _algorithm(args: argparse.Namespace) -> str | tuple[str, ...]:
    names = tuple(x.strip() for x in args.algorithm.split(","))
    return names[0] if len(names) == 1 else names


def _fail(err: Exception) -> int:
    print(f"scaleout sim: error: {err}", file=sys.stderr)
    return 2


def handle_collective(args: argparse.Namespace) -> int:
    from scaleout.sim.collectives import collective_cost
    from scaleout.sim.themis import themis_gain
    from scaleout.sim.units import format_time, parse_bytes

    try:
        topo = _topology(args)
        size = parse_bytes(args.size)
        cost = collective_cost(topo, op=args.op, algorithm=_algorithm(args), nbytes=size, flat=args.flat)
        data = {"op": args.op, "algorithm": cost.algorithm, "topology": topo.describe(), "npus": topo.npus,
                "bytes": size, "time_s": cost.time, "algbw_GBps": cost.algbw / 1e9,
                "busbw_GBps": cost.busbw / 1e9, "utilisation": list(cost.utilisation()),
                "phases": [vars(p) for p in cost.phases]}
        lines = [f"{args.op} of {args.size} on {topo.describe()} ({topo.npus} NPUs), {cost.algorithm}: "
                 f"{format_time(cost.time)}, algbw {cost.algbw / 1e9:.3f} GB/s, busbw {cost.busbw / 1e9:.3f} GB/s",
                 format_table(["dim", "phase", "start", "end", "bytes in", "link util"],
                              [[p.dim, p.op, format_time(p.start), format_time(p.end), int(p.nbytes),
                                f"{cost.utilisation()[p.dim]:.2f}"] for p in cost.phases])]
        if args.themis:
            if args.op != "allreduce":
                raise ValueError("--themis schedules all-reduce only")
            algo = _algorithm(args)
            gain, base, them = themis_gain(topo, nbytes=size, chunks=args.chunks,
                                           algorithm=algo if isinstance(algo, str) else algo[0])
            data["themis"] = {"chunks": args.chunks, "baseline_s": base.time, "themis_s": them.time,
                              "gain": gain, "baseline_utilisation": list(base.utilisation()),
                              "themis_utilisation": list(them.utilisation())}
            lines.append(f"chunked x{args.chunks}: fixed order {format_time(base.time)}, Themis "
                         f"{format_time(them.time)}: gain {gain:.2f}x; link utilisation "
                         f"{[round(u, 2) for u in base.utilisation()]} -> {[round(u, 2) for u in them.utilisation()]}")
    except (ValueError, TypeError) as err:
        return _fail(err)
    _emit(args, data, "\n".join(lines))
    return 0


def _workload_and_config(args: argparse.Namespace):
    from scaleout.scheduler.config import SchedulerConfig
    from scaleout.sim.iteration import CodecModel, IterationConfig
    from scaleout.sim.models import DEVICES, model_workload
    from scaleout.sim.trace import read_trace
    from scaleout.sim.units import parse_bytes

    codec = CodecModel()
    if args.codec_ratio != 1.0 or args.codec_cost or args.codec_gather:
        codec = CodecModel(name="codec", ratio=args.codec_ratio, seconds_per_byte=args.codec_cost / (1 << 20),
                           summable=not args.codec_gather)
    bucket = parse_bytes(args.bucket)
    config = IterationConfig(mode=args.mode, algorithm=_algorithm(args), flat=args.flat, codec=codec,
                             trace=bool(getattr(args, "chrome", None)), scheduler=SchedulerConfig(
                                 policy=args.policy, bucket_bytes=bucket,
                                 first_bucket_bytes=min(bucket, 1 << 20)))
    if args.chakra:
        return None, config
    if args.trace:
        workload = read_trace(args.trace)
        return workload.scaled(batch_size=args.batch or workload.batch_size, speed=args.speed), config
    device = DEVICES[args.device] if args.device in DEVICES else float(args.device)
    return model_workload(args.model, device=device, batch_size=args.batch or 32), config


def handle_run(args: argparse.Namespace) -> int:
    from scaleout.sim.chakra import et_path, load_schema, read_et, write_et
    from scaleout.sim.chrome import write_chrome_trace
    from scaleout.sim.graph import chakra_nodes, run_graph
    from scaleout.sim.iteration import simulate
    from scaleout.sim.units import format_bytes, format_time

    try:
        workload, config = _workload_and_config(args)
        topo = _topology(args)
        if args.nodes:
            topo = topo.with_npus(args.nodes)
        started = time.perf_counter()
        if workload is None:  # a Chakra trace: execute its graph
            _, nodes = read_et(args.chakra)
            g = run_graph(nodes, topo, algorithm=config.algorithm, flat=config.flat)
            data = {"chakra": args.chakra, "npus": topo.npus, "iteration_s": g.time, "compute_s": g.compute_s,
                    "comm_s": g.comm_s, "nodes": g.nodes, "efficiency": g.compute_s / g.time if g.time else 1.0}
            text = (f"{args.chakra} on {topo.describe()} ({topo.npus} NPUs): {g.nodes} nodes, iteration "
                    f"{format_time(g.time)}, compute {format_time(g.compute_s)}, network {format_time(g.comm_s)}")
            spans = g.spans
        else:
            r = simulate(workload, topo, config)
            data = {**r.as_dict(), "topology": topo.describe(), "policy": args.policy, "mode": args.mode,
                    "grad_bytes": workload.grad_bytes, "wall_s": time.perf_counter() - started}
            text = "\n".join([
                f"{workload.name} x{workload.batch_size}/rank on {topo.describe()} ({topo.npus} NPUs), "
                f"{args.policy}/{args.mode}, {r.buckets} buckets / {r.chunks} chunks of {format_bytes(workload.grad_bytes)}",
                format_table(["iteration", "compute", "exposed comm", "network", "efficiency", "link util"],
                             [[format_time(r.iteration_s), format_time(r.compute_s), format_time(r.exposed_s),
                               format_time(r.comm_s), f"{r.efficiency * 100:.1f}%",
                               ",".join(f"{u:.2f}" for u in r.utilisation)]])])
            spans = r.spans
            if args.write_chakra:
                schema = load_schema()
                nodes = chakra_nodes(workload, config)
                for rank in range(args.ranks):
                    write_et(et_path(args.write_chakra, rank), schema.GlobalMetadata(version="0.0.4"), nodes)
                text += f"\nwrote {et_path(args.write_chakra, 0)} .. {et_path(args.write_chakra, args.ranks - 1)}"
        if args.chrome:
            write_chrome_trace(args.chrome, spans, ranks=args.ranks, metadata={"command": args.command_line})
            text += f"\nwrote {args.chrome}"
    except (ValueError, TypeError, OSError, ImportError) as err:
        return _fail(err)
    _emit(args, data, text)
    return 0


def _counts(text: str) -> list[int]:
    if ".." in text:
        low, high = (int(x) for x in text.split(".."))
        out, n = [], low
        while n <= high:
            out.append(n)
            n *= 2
        return out
    return [int(x) for x in text.split(",")]


def handle_sweep(args: argparse.Namespace) -> int:
    from scaleout.sim.scaling import sweep
    from scaleout.sim.units import format_time

    try:
        workload, config = _workload_and_config(args)
        if workload is None:
            raise ValueError("sweep takes --model or --trace (a Chakra trace is run with 'sim run')")
        topo = _topology(args)
        started = time.perf_counter()
        points = sweep(workload, topo, _counts(args.nodes), config)
        wall = time.perf_counter() - started
    except (ValueError, TypeError, OSError) as err:
        return _fail(err)
    rows = [[p.npus, format_time(p.result.iteration_s), format_time(p.result.exposed_s),
             f"{p.efficiency * 100:.1f}%", f"{p.npus * workload.batch_size / p.result.iteration_s:.1f}",
             ",".join(f"{u:.2f}" for u in p.result.utilisation)] for p in points]
    data = {"workload": workload.name, "batch_size": workload.batch_size, "topology": topo.describe(),
            "policy": args.policy, "mode": args.mode, "wall_s": wall,
            "points": [{"npus": p.npus, **p.result.as_dict()} for p in points]}
    text = (f"{workload.name} x{workload.batch_size}/rank, {args.policy}/{args.mode}, on {topo.describe()} "
            f"resized ({wall:.2f} s)\n" + format_table(
                ["NPUs", "iteration", "exposed", "efficiency", "samples/s", "link util"], rows))
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            text += "\n(no plot: matplotlib is not installed; pip install 'scaleout[plot]')"
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.semilogx([p.npus for p in points], [p.efficiency * 100 for p in points], marker="o", base=2)
            ax.set_xlabel("NPUs")
            ax.set_ylabel("scaling efficiency (%)")
            ax.set_title(f"{workload.name}: {args.policy}/{args.mode}")
            fig.savefig(args.plot, dpi=100, bbox_inches="tight")
            text += f"\nwrote {args.plot}"
    _emit(args, data, text)
    return 0


def handle_validate(args: argparse.Namespace) -> int:
    from scaleout.sim.published import published_scenarios
    from scaleout.sim.testbed_cases import testbed_scenarios
    from scaleout.sim.validation import validate

    scenarios = []
    if args.only in (None, "published"):
        scenarios += published_scenarios()
    if args.only in (None, "testbed"):
        scenarios += testbed_scenarios()
    report = validate(scenarios)
    print(format_table(["scenario", "measured", "predicted", "error", "bound", "", "source"], report.rows()))
    for line in report.summaries:
        print(line)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({**report.as_dict(), "command": args.command_line}, f, indent=1)
    print(f"wrote {args.json}; {'all bounds met' if report.ok else 'FAILED: a bound is exceeded'}")
    return 0 if report.ok else 1
