"""Arguments and output shared by the ``scaleout sim`` subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys

from scaleout.sim.network import Topology

__all__ = ["network_args", "json_arg", "emit", "topology_from", "algorithm_from", "fail",
           "finite_float"]

# What --topology, --bandwidth, --latency and --kind are when not given (and no --preset).
_NETWORK_DEFAULTS = {"topology": "8", "bandwidth": "100Gbps", "latency": "5us", "kind": "ring"}


def network_args(p: argparse.ArgumentParser) -> None:
    """Add the network and algorithm options to ``p``."""
    p.add_argument("--preset", default=None,
                   help="a named cluster (see docs/simulator.md): its topology, bandwidths, "
                        "latencies and kinds, so not with those options")
    p.add_argument(
        "--topology",
        default=None,
        help="NPUs per dimension, innermost first, e.g. 8 or 8x128 (default 8)",
    )
    p.add_argument(
        "--bandwidth", default=None,
        help="per dimension, comma separated (100Gbps, 300GB/s; default 100Gbps, at least 1bps)"
    )
    p.add_argument("--latency", default=None, help="per dimension, comma separated (default 5us)")
    p.add_argument("--kind", default=None,
                   help="ring, fully_connected or switch, per dimension (default ring)")
    p.add_argument(
        "--algorithm",
        default="ring",
        help="ring, direct, halving_doubling or double_binary_tree (one, or one per dimension)",
    )
    p.add_argument(
        "--flat", action="store_true", help="one ring over all NPUs instead of hierarchical"
    )


def finite_float(text: str) -> float:
    """An argparse ``type``: a float, but not nan or inf (which would price as nan/inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


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


def emit(args: argparse.Namespace, data: dict, text: str) -> int:
    """Print ``text`` (and write ``data`` to ``--json FILE``), or ``data`` for a bare ``--json``;
    the exit code: 2, with nothing printed, when a figure is not finite (JSON cannot hold it,
    and a time of inf says nothing)."""
    try:
        encoded = json.dumps(data, indent=1, allow_nan=False)
    except ValueError:
        return fail(ValueError("a result is not a finite number: an input is too large or too "
                               "small to price (a size, a rate, a latency, a time)"))
    if args.json == "-":
        print(encoded)
        return 0
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(encoded)
        print(f"wrote {args.json}")
    return 0


def topology_from(args: argparse.Namespace) -> Topology:
    """``--preset``'s topology, or one from ``--topology --bandwidth --latency --kind``.

    Raises:
        ValueError: ``--preset`` with any of those (the preset defines them all).
    """
    from scaleout.sim.network import parse_topology, preset

    given = {name: getattr(args, name) for name in _NETWORK_DEFAULTS
             if getattr(args, name) is not None}
    if args.preset:
        if given:
            raise ValueError(
                f"--preset {args.preset} defines the topology, bandwidths, latencies and kinds: "
                f"give it without {', '.join(f'--{name}' for name in given)} (or use those "
                "options alone)")
        return preset(args.preset).topology
    value = {**_NETWORK_DEFAULTS, **given}
    split = lambda text: [x.strip() for x in text.split(",")]  # noqa: E731
    return parse_topology(
        value["topology"],
        bandwidths=split(value["bandwidth"]),
        latencies=split(value["latency"]),
        kinds=split(value["kind"]),
    )


def algorithm_from(args: argparse.Namespace) -> str | tuple[str, ...]:
    """``--algorithm``: one name, or one per dimension."""
    names = tuple(x.strip() for x in args.algorithm.split(","))
    return names[0] if len(names) == 1 else names


def fail(err: Exception) -> int:
    """Report a user error on stderr; exit code 2."""
    print(f"scaleout sim: error: {err}", file=sys.stderr)
    return 2
