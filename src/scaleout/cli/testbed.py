"""``scaleout testbed``: bring an emulated cluster up, show it, take it down, calibrate it."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from scaleout.launch.stop_signals import Stopped, raise_on_stop
from scaleout.testbed import (
    DEFAULT_NAME,
    Testbed,
    TestbedConfig,
    TestbedError,
    TestbedState,
    list_testbeds,
    remove_stale,
)
from scaleout.testbed.units import format_rate

__all__ = ["register", "handler"]

_EXAMPLE = """\
examples:
  scaleout testbed up --hosts 2 --rate 1gbit
  scaleout testbed status
  ip netns exec so-tb-h1 python -c 'print("hello from host 1")'
  scaleout testbed calibrate            # gloo allreduce bandwidth vs the rate
  scaleout testbed down

Hosts are network namespaces so-<name>-h<i> with interface so-eth0; ranks bind gloo
to it with GLOO_SOCKET_IFNAME=so-eth0 and rendezvous at host 0 (MASTER_ADDR); status's env
column is what a rank started by hand needs (SCALEOUT_TESTBED_HOST: a machine of its own).
--delay/--jitter/--loss (e.g. --delay 50us) need the kernel's netem qdisc.
Needs root and iproute2 (ip, tc). See docs/testbed.md.
"""


def register(subparsers: Any) -> None:
    """Add the ``testbed`` subcommand (``up``/``down``/``status``/``calibrate``)."""
    parser = subparsers.add_parser(
        "testbed",
        help="emulated cluster: hosts as network namespaces on a shaped switch",
        description="Emulate a cluster network on this machine: hosts are Linux network "
        "namespaces joined by a bridge, each link shaped with tc (rate, delay, jitter, loss).",
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=handler, action=None)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    up = actions.add_parser("up", help="bring a testbed up", epilog=_EXAMPLE,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("--hosts", type=int, required=True, help="number of hosts (namespaces)")
    up.add_argument("--rate", required=True, help="link rate per direction, e.g. 100mbit, 1gbit, 10gbit")
    up.add_argument("--delay", default="0us", help="one-way added latency host to host, e.g. 50us, 1ms")
    up.add_argument("--jitter", default="0us", help="spread of the added latency, e.g. 10us")
    up.add_argument("--loss", default="0%", help="packet loss host to host, e.g. 0.1%%")
    up.add_argument("--mtu", type=int, default=9000, help="link MTU (default 9000, jumbo)")
    up.add_argument("--subnet", default=None, help="IPv4 subnet for hosts (default: a free private /24)")

    actions.add_parser("down", help="remove a testbed (and any stale ones)")
    status = actions.add_parser("status", help="list testbeds and their hosts")

    cal = actions.add_parser("calibrate", help="measure gloo allreduce bandwidth/latency on a testbed")
    cal.add_argument("--ranks", type=int, default=2, help="ranks, one per host (default 2)")
    cal.add_argument("--nbytes", type=int, default=None,
                     help="allreduce size in bytes, >= 4 (default: ~0.5 s worth at the rate, "
                          "4 MiB to 256 MiB)")
    cal.add_argument("--iters", type=int, default=5, help="timed large allreduces (default 5)")
    cal.add_argument("--repeat", type=int, default=1, help="repeat the whole measurement (default 1)")

    for sub in (up, actions.choices["down"], cal):
        sub.add_argument("--name", default=DEFAULT_NAME, help=f"testbed name (default {DEFAULT_NAME!r})")
    status.add_argument("--name", default=None, help="only this testbed (default: all)")
    for sub in (up, actions.choices["down"], status, cal):
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
    actions.choices["down"].add_argument(
        "--all", action="store_true",
        help="remove every testbed this state directory records ($SCALEOUT_TESTBED_DIR)")
    actions.choices["down"].add_argument(
        "--orphans", action="store_true",
        help="also remove every so-* namespace no testbed of this state directory claims: "
             "leftovers, but also testbeds of other state directories, in use or not")


class _Usage(ValueError):
    """A value given on the command line that no testbed could take: exit code 2, as
    argparse's own refusals (since stop 51; before, 1, as a testbed that failed)."""


def handler(args: argparse.Namespace) -> int:
    """Run ``scaleout testbed ACTION``; returns the exit code (2: a bad value given)."""
    actions = {"up": _up, "down": _down, "status": _status, "calibrate": _calibrate}
    if args.action not in actions:
        print("usage: scaleout testbed {up,down,status,calibrate} ... (see --help)", file=sys.stderr)
        return 2
    try:
        return actions[args.action](args)
    except _Usage as err:
        print(f"scaleout testbed {args.action}: error: {err}", file=sys.stderr)
        return 2
    except (TestbedError, ValueError, TypeError) as err:
        print(f"scaleout testbed {args.action}: error: {err}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    try:
        config = TestbedConfig(
            hosts=args.hosts, rate=args.rate, delay=args.delay, jitter=args.jitter,
            loss=args.loss, mtu=args.mtu, name=args.name, subnet=args.subnet,
        )
    except (ValueError, TypeError) as err:
        raise _Usage(str(err)) from err
    testbed = Testbed(config)
    try:  # SIGTERM, SIGHUP mid-way: what was made is removed, as on Ctrl-C (since stop 51)
        with raise_on_stop():
            state = testbed.up(persistent=True)
    except ValueError as err:  # --subnet taken by another testbed (since stop 52)
        raise _Usage(str(err)) from err
    except Stopped as err:
        testbed.down()  # (up() removes a half-made testbed itself; this, one just made)
        print(f"scaleout testbed up: stopped by {signal.Signals(err.signum).name}; testbed "
              f"{config.name!r} was not left up", file=sys.stderr)
        return 128 + err.signum
    _print_states([state], as_json=args.json)
    return 0


def _down(args: argparse.Namespace) -> int:
    removed: list[str] = []
    if args.all:
        for state in list_testbeds():
            tb = Testbed.attach(state.name) if not state.stale else None
            if tb is not None:
                removed += list(state.namespaces)
                tb.down()
    else:
        try:
            tb = Testbed.attach(args.name)
        except TestbedError:
            tb = None
        if tb is not None:
            removed += list(tb.state.namespaces)
            tb.down()
    # only what this state directory records (since stop 52; before, --all also removed
    # every so-* namespace it did not record: other state directories' testbeds)
    if args.orphans:
        removed += remove_stale(all_orphans=True)
    else:
        removed += remove_stale(orphans_of=None if args.all else args.name)
    if args.json:
        print(json.dumps({"removed": removed}))
    elif removed:
        print(f"removed {len(removed)} namespaces: {' '.join(removed)}")
    else:
        print("no testbed was up" if args.all else f"no testbed named {args.name!r} was up")
    return 0


def _status(args: argparse.Namespace) -> int:
    states = list_testbeds()
    if args.name is not None:
        named = [s for s in states if s.name == args.name]
        if not named:
            up = ", ".join(repr(s.name) for s in states) or "none"
            raise TestbedError(f"no testbed named {args.name!r} (up: {up})")
        states = named
    _print_states(states, as_json=args.json)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from scaleout.testbed.calibrate import calibrate, check_sizes

    if args.repeat < 1:
        raise _Usage(f"--repeat: expected an integer >= 1, got {args.repeat}")
    if args.ranks < 2:
        raise _Usage(f"--ranks: expected an integer >= 2 (a lone rank's allreduce crosses no "
                     f"link), got {args.ranks}")
    try:  # before the testbed: nothing to attach
        check_sizes(nbytes=args.nbytes, iters=args.iters)
    except ValueError as err:
        raise _Usage(str(err)) from err
    tb = Testbed.attach(args.name)
    rate = tb.config.rate_bps
    nbytes = _default_nbytes(rate) if args.nbytes is None else args.nbytes
    rows, results = [], []
    for i in range(args.repeat):
        result = calibrate(tb, ranks=args.ranks, nbytes=nbytes, iters=args.iters)
        results.append(result.to_dict())
        rows.append([
            str(i), tb.config.rate, f"{nbytes >> 20} MiB",
            format_rate(result.busbw_median_bps), f"{result.busbw_ratio:.3f}",
            f"{result.busbw_spread:.3f}", f"{result.small_allreduce_s * 1e6:.0f} us",
            f"{result.tcp_rtt_s * 1e6:.0f} us",
        ])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _table(["run", "rate", "size", "busbw", "busbw/rate", "spread", "allreduce 4B", "tcp rtt"], rows)
    return 0


def _default_nbytes(rate_bps: int) -> int:
    """A power-of-two size taking ~0.5 s at the rate, 4 MiB to 256 MiB."""
    size = 4 << 20
    while size < 256 << 20 and size * 8 / rate_bps < 0.35:
        size *= 2
    return size


def _print_states(states: list[TestbedState], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps([s.to_dict() for s in states], indent=2))
        return
    if not states:
        print("no testbed is up")
        return
    for state in states:
        cfg = state.config
        owner = "cli" if state.owner_pid is None else f"pid {state.owner_pid}"
        print(
            f"testbed {cfg.name!r}: {cfg.hosts} hosts, rate {cfg.rate}, delay {cfg.delay}, "
            f"jitter {cfg.jitter}, loss {cfg.loss}, mtu {cfg.mtu}, subnet {cfg.subnet}, "
            f"owner {owner}{' (STALE)' if state.stale else ''}"
        )
        rows = [
            [str(h.index), h.namespace, h.ifname, h.address,
             f"ip netns exec {h.namespace} ...",
             " ".join(f"{name}={value}" for name, value in h.env().items())]
            for h in state.hosts
        ]
        _table(["host", "namespace", "iface", "address", "run with", "env"], rows)


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for line in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
