"""How a link of a :class:`TestbedConfig` becomes ``tc`` qdiscs.

Each host's link is a veth pair: ``so-eth0`` in the host's namespace, ``h<i>`` on the
switch (a bridge in its own namespace). A real full-duplex NIC carries the rate in
each direction, so both ends are shaped:

* host egress (``so-eth0``, upload): ``netem`` for delay/jitter/loss when asked
  for, with a ``tbf`` child for the rate; just ``tbf`` otherwise;
* switch egress (``h<i>``, download): ``tbf`` for the rate. Its queue only fills
  when several hosts send to one (incast), like a switch port buffer.

Delay, jitter and loss are applied once per host-to-host path (at the sender), so
``delay`` is the one-way latency added between two hosts.

Token bucket sizing (measured, see ``docs/testbed.md``): the bucket must hold the
tokens that pile up while the qdisc's timer wakes late on a busy machine, else the
link runs below its rate; 1 ms of traffic does, and at least one 64 KiB GSO
super-packet (smaller buckets make ``tbf`` split those, and measured slower at
100mbit on a loaded machine). A larger bucket lets the first ``burst`` bytes after an
idle period pass faster than the rate, so it stays that small. The queue
holds ``QUEUE_TIME_S`` of traffic at the rate, like a modest switch buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaleout.testbed.config import TestbedConfig
from scaleout.testbed.units import format_time

__all__ = ["LinkShaping", "plan_link", "BURST_TIME_S", "QUEUE_TIME_S"]

BURST_TIME_S = 0.001  # tokens for 1 ms of traffic at the rate, at least one GSO packet
GSO_MAX_BYTES = 65536 + 14  # largest skb a veth hands the qdisc (a GSO super-packet)
QUEUE_TIME_S = 0.010  # queue limit: 10 ms of traffic at the rate ...
MIN_QUEUE_BYTES = 512 * 1024  # ... but at least 512 KiB
ETH_HEADER_BYTES = 14  # qdiscs count the Ethernet header, not preamble/FCS/gap
_MIN_NETEM_PACKETS = 1000


@dataclass(frozen=True, kw_only=True)
class LinkShaping:
    """The ``tc`` commands that shape one host's link, both directions.

    Attributes:
        burst_bytes: token bucket size of each ``tbf``.
        limit_bytes: queue limit of each ``tbf``.
        host_egress: ``tc`` argument lists for ``so-eth0`` in the host namespace.
        switch_egress: ``tc`` argument lists for the switch port ``h<i>``.
    """

    burst_bytes: int
    limit_bytes: int
    host_egress: tuple[tuple[str, ...], ...]
    switch_egress: tuple[tuple[str, ...], ...]


def plan_link(config: TestbedConfig, *, host_dev: str, switch_dev: str) -> LinkShaping:
    """Plan the qdiscs of one host link.

    Args:
        config: the testbed (rate, delay, jitter, loss, MTU).
        host_dev: the interface inside the host namespace.
        switch_dev: the host's port on the switch.

    Returns:
        The commands (arguments after ``tc``) for each end of the link.
    """
    rate = config.rate_bps
    burst = max(
        math.ceil(rate * BURST_TIME_S / 8), GSO_MAX_BYTES, 2 * (config.mtu + ETH_HEADER_BYTES)
    )
    limit = burst + max(math.ceil(rate * QUEUE_TIME_S / 8), MIN_QUEUE_BYTES)
    tbf = ("tbf", "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit))

    host: list[tuple[str, ...]] = []
    if config.needs_netem:
        netem = ["netem", "limit", str(_netem_limit(config))]
        if config.delay_s > 0:
            netem += ["delay", format_time(config.delay_s)]
            if config.jitter_s > 0:
                netem += [format_time(config.jitter_s)]
        if config.loss_fraction > 0:
            netem += ["loss", f"{config.loss_fraction * 100:g}%"]
        host.append(("qdisc", "replace", "dev", host_dev, "root", "handle", "1:", *netem))
        host.append(("qdisc", "replace", "dev", host_dev, "parent", "1:1", "handle", "10:", *tbf))
    else:
        host.append(("qdisc", "replace", "dev", host_dev, "root", "handle", "1:", *tbf))
    switch = (("qdisc", "replace", "dev", switch_dev, "root", "handle", "1:", *tbf),)
    return LinkShaping(
        burst_bytes=burst, limit_bytes=limit, host_egress=tuple(host), switch_egress=switch
    )


def _netem_limit(config: TestbedConfig) -> int:
    """Packets netem must hold: everything sent during the delay, with margin."""
    in_flight_bytes = config.rate_bps / 8 * (config.delay_s + config.jitter_s)
    return max(_MIN_NETEM_PACKETS, 4 * math.ceil(in_flight_bytes / config.mtu))
