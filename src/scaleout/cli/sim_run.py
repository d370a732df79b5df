"""``scaleout sim run`` and ``scaleout sim sweep``: training iterations and scaling curves."""

from __future__ import annotations

import argparse
import time

from scaleout.cli.sim_args import algorithm_from, emit, fail, topology_from
from scaleout.sim.config import IterationConfig
from scaleout.sim.workload import Workload
from scaleout.table import format_table

__all__ = ["handle_run", "handle_sweep"]


def _workload_and_config(args: argparse.Namespace) -> tuple[Workload | None, IterationConfig]:
    """The workload (``None`` for a Chakra trace, which is run as a graph) and its config."""
    from scaleout.scheduler.config import SchedulerConfig
    from scaleout.sim.config import CodecModel, codec_model
    from scaleout.sim.models import DEVICES, model_workload
    from scaleout.sim.trace import read_trace
    from scaleout.sim.units import parse_bytes, parse_time

    codec = codec_model(args.codec)
    custom = [f"--{name.replace('_', '-')}"
              for name in ("codec_ratio", "codec_cost", "codec_gather")
              if getattr(args, name) not in (None, False)]
    if custom and codec.name:
        raise ValueError(f"--codec {args.codec} is a measured codec (its own ratio and cost) "
                         f"and {', '.join(custom)} are for a codec not measured here: give one "
                         "or the other")
    if custom:
        codec = CodecModel(
            name="codec",
            ratio=1.0 if args.codec_ratio is None else args.codec_ratio,
            seconds_per_byte=(args.codec_cost or 0.0) / (1 << 20),
            summable=not args.codec_gather,
        )
    bucket = parse_bytes(args.bucket)
    config = IterationConfig(
        mode=args.mode,
        algorithm=algorithm_from(args),
        flat=args.flat,
        codec=codec,
        trace=bool(getattr(args, "chrome", None)),
        pipeline=args.pipeline,
        pipeline_chunks=args.pipeline_chunks,
        host_s_per_byte=args.host_cost / (1 << 20),
        cycle_s=parse_time(args.cycle),
        scheduler=SchedulerConfig(
            policy=args.policy, bucket_bytes=bucket, first_bucket_bytes=min(bucket, 1 << 20)
        ),
    )
    if args.speed is not None and not args.trace:
        raise ValueError("--speed applies to --trace (a model's compute comes from --device)")
    if args.device is not None and (args.trace or args.chakra):
        raise ValueError("--device applies to --model (a trace's compute was measured: scale it "
                         "with --speed)")
    if args.chakra:
        changed = [name for name, default in args.graph_ignores.items()
                   if getattr(args, name) != default]
        changed += ["write_chakra"] if getattr(args, "write_chakra", None) else []
        if changed:
            raise ValueError(
                f"--chakra runs the trace's own graph (its batch, buckets, codec and order are "
                f"recorded in it): {', '.join('--' + n.replace('_', '-') for n in changed)} "
                f"{'does' if len(changed) == 1 else 'do'} not apply to it")
        return None, config
    if args.trace:
        speed = 1.0 if args.speed is None else args.speed
        if not speed > 0:
            raise ValueError(f"--speed must be a finite number > 0, got {speed}")
        workload = read_trace(args.trace)
        return workload.scaled(
            batch_size=workload.batch_size if args.batch is None else args.batch,
            speed=speed), config
    name = "p100" if args.device is None else args.device
    if name in DEVICES:
        device = DEVICES[name]
    else:
        try:
            device = float(name)
        except ValueError:
            raise ValueError(
                f"--device must be one of {', '.join(DEVICES)} or a FLOP/s rate like 5e12, "
                f"got {name!r}"
            ) from None
    return model_workload(args.model, device=device,
                          batch_size=32 if args.batch is None else args.batch), config


def handle_run(args: argparse.Namespace) -> int:
    """``scaleout sim run``: one iteration of a model, a trace or a Chakra file; exit code."""
    from scaleout.sim.chakra import et_path, load_schema, read_et, write_et
    from scaleout.sim.chrome import write_chrome_trace
    from scaleout.sim.graph import chakra_nodes, run_graph
    from scaleout.sim.iteration import simulate
    from scaleout.sim.units import format_bytes, format_time

    try:
        workload, config = _workload_and_config(args)
        topo = topology_from(args)
        if args.nodes is not None:
            topo = topo.with_npus(args.nodes)
        ranks = _ranks(args, topo.npus)
        started = time.perf_counter()
        if workload is None:  # a Chakra trace: execute its graph
            _, nodes = read_et(args.chakra)
            g = run_graph(nodes, topo, algorithm=config.algorithm, flat=config.flat)
            data = {
                "chakra": args.chakra,
                "npus": topo.npus,
                "iteration_s": g.time,
                "compute_s": g.compute_s,
                "comm_s": g.comm_s,
                "nodes": g.nodes,
                "efficiency": g.compute_s / g.time if g.time else 1.0,
            }
            text = (
                f"{args.chakra} on {topo.describe()} ({topo.npus} NPUs): {g.nodes} nodes, "
                "iteration "
                f"{format_time(g.time)}, compute {format_time(g.compute_s)}, "
                f"network {format_time(g.comm_s)}"
            )
            spans = g.spans
        else:
            r = simulate(workload, topo, config)
            data = {
                **r.as_dict(),
                "topology": topo.describe(),
                "policy": args.policy,
                "mode": args.mode,
                "grad_bytes": workload.grad_bytes,
                "wall_s": time.perf_counter() - started,
            }
            text = "\n".join(
                [
                    f"{workload.name} x{workload.batch_size}/rank on {topo.describe()} "
                    f"({topo.npus} NPUs), {args.policy}/{args.mode}, {r.buckets} buckets / "
                    f"{r.chunks} chunks of {format_bytes(workload.grad_bytes)}",
                    format_table(
                        [
                            "iteration",
                            "compute",
                            "exposed comm",
                            "network",
                            "efficiency",
                            "link util",
                        ],
                        [
                            [
                                format_time(r.iteration_s),
                                format_time(r.compute_s),
                                format_time(r.exposed_s),
                                format_time(r.comm_s),
                                f"{r.efficiency * 100:.1f}%",
                                ",".join(f"{u:.2f}" for u in r.utilisation),
                            ]
                        ],
                    ),
                ]
            )
            spans = r.spans
            if args.write_chakra:
                schema = load_schema()
                nodes = chakra_nodes(workload, config)
                for rank in range(ranks):
                    write_et(
                        et_path(args.write_chakra, rank),
                        schema.GlobalMetadata(version="0.0.4"),
                        nodes,
                    )
                last = et_path(args.write_chakra, ranks - 1)
                text += f"\nwrote {et_path(args.write_chakra, 0)} .. {last}"
        if args.chrome:
            write_chrome_trace(
                args.chrome, spans, ranks=ranks, metadata={"command": args.command_line}
            )
            text += f"\nwrote {args.chrome}"
    except (ValueError, TypeError, OSError, ImportError) as err:
        return fail(err)
    return emit(args, data, text)


def _ranks(args: argparse.Namespace, npus: int) -> int:
    """``--ranks``: the ranks written to ``--chrome`` / ``--write-chakra`` (default 4, or all
    of a smaller topology's NPUs).

    Raises:
        ValueError: below 1, above the topology's NPUs, or given with neither output.
    """
    if args.ranks is None:
        return min(4, npus)
    if not (args.chrome or args.write_chakra):
        raise ValueError("--ranks applies to --chrome and --write-chakra")
    if not 1 <= args.ranks <= npus:
        raise ValueError(f"--ranks must be from 1 to the topology's {npus} NPUs, got {args.ranks}")
    return args.ranks


def _counts(text: str) -> list[int]:
    """``"8..64"`` -> [8, 16, 32, 64]; ``"2,3,5"`` -> [2, 3, 5]."""
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split(".."))
            counts = [low << k for k in range(max(high // max(low, 1), 1).bit_length())]
            counts = [n for n in counts if n <= high]
        else:
            counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(
            f"--nodes must be LOW..HIGH (powers of 2 from LOW) or a comma list of "
            f"ints >= 1, got {text!r}"
        )
    return counts


def handle_sweep(args: argparse.Namespace) -> int:
    """``scaleout sim sweep``: the scaling curve as a table, JSON and a plot; exit code."""
    from scaleout.sim.scaling import sweep
    from scaleout.sim.units import format_time

    try:
        workload, config = _workload_and_config(args)
        if workload is None:
            raise ValueError(
                "sweep takes --model or --trace (a Chakra trace is run with 'sim run')"
            )
        topo = topology_from(args)
        started = time.perf_counter()
        points = sweep(workload, topo, _counts(args.nodes), config)
        wall = time.perf_counter() - started
    except (ValueError, TypeError, OSError) as err:
        return fail(err)
    rows = [
        [
            p.npus,
            format_time(p.result.iteration_s),
            format_time(p.result.exposed_s),
            f"{p.efficiency * 100:.1f}%",
            f"{p.npus * workload.batch_size / p.result.iteration_s:.1f}",
            ",".join(f"{u:.2f}" for u in p.result.utilisation),
        ]
        for p in points
    ]
    data = {
        "workload": workload.name,
        "batch_size": workload.batch_size,
        "topology": topo.describe(),
        "policy": args.policy,
        "mode": args.mode,
        "wall_s": wall,
        "points": [{"npus": p.npus, **p.result.as_dict()} for p in points],
    }
    text = (
        f"{workload.name} x{workload.batch_size}/rank, {args.policy}/{args.mode}, "
        f"on {topo.describe()} "
        f"resized ({wall:.2f} s)\n"
        + format_table(
            ["NPUs", "iteration", "exposed", "efficiency", "samples/s", "link util"], rows
        )
    )
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            text += "\n(no plot: matplotlib is not installed; pip install 'scaleout[plot]')"
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.semilogx(
                [p.npus for p in points], [p.efficiency * 100 for p in points], marker="o", base=2
            )
            ax.set_xlabel("NPUs")
            ax.set_ylabel("scaling efficiency (%)")
            ax.set_title(f"{workload.name}: {args.policy}/{args.mode}")
            fig.savefig(args.plot, dpi=100, bbox_inches="tight")
            text += f"\nwrote {args.plot}"
    return emit(args, data, text)
