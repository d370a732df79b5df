"""Arguments and output shared by the ``scaleout sim`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from scaleout.sim.network import Topology

__all__ = ["network_args", "json_arg", "emit", "topology_from", "algorithm_from", "fail"]


def network_args(p: argparse.ArgumentParser, default_topology: str | None = "8") -> None:
    """Add the network and algorithm options to ``p``."""
    p.add_argument("--preset", default=None, help="a named cluster (see docs/simulator.md)")
    p.add_argument(
        "--topology",
        default=default_topology,
        help="NPUs per dimension, innermost first, e.g. 8 or 8x128",
    )
    p.add_argument(
        "--bandwidth", default="100Gbps", help="per dimension, comma separated (100Gbps, 300GB/s)"
    )
    p.add_argument("--latency", default="5us", help="per dimension, comma separated (default 5us)")
    p.add_argument("--kind", default="ring", help="ring, fully_connected or switch, per dimension")
    p.add_argument(
        "--algorithm",
        default="ring",
        help="ring, direct, halving_doubling or double_binary_tree (one, or one per dimension)",
    )
    p.add_argument(
        "--flat", action="store_true", help="one ring over all NPUs instead of hierarchical"
    )


def json_arg(p: argparse.ArgumentParser) -> None:
    """``--json`` alone prints JSON; ``--json FILE`` prints the table and writes FILE."""
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="print JSON (or write it to FILE)",
    )


def emit(args: argparse.Namespace, data: dict, text: str) -> None:
    """Print ``text`` (and write ``data`` to ``--json FILE``), or ``data`` for a bare ``--json``."""
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")


def topology_from(args: argparse.Namespace) -> Topology:
    """``--preset``'s topology, or one from ``--topology --bandwidth --latency --kind``."""
    from scaleout.sim.network import parse_topology, preset

    if args.preset:
        return preset(args.preset).topology
    split = lambda text: [x.strip() for x in text.split(",")]  # noqa: E731
    return parse_topology(
        args.topology or "8",
        bandwidths=split(args.bandwidth),
        latencies=split(args.latency),
        kinds=split(args.kind),
    )


def algorithm_from(args: argparse.Namespace) -> str | tuple[str, ...]:
    """``--algorithm``: one name, or one per dimension."""
    names = tuple(x.strip() for x in args.algorithm.split(","))
    return names[0] if len(names) == 1 else names


def fail(err: Exception) -> int:
    """Report a user error on stderr; exit code 2."""
    print(f"scaleout sim: error: {err}", file=sys.stderr)
    return 2
