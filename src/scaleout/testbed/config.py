"""What an emulated cluster looks like: :class:`TestbedConfig`."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from scaleout.testbed.units import parse_percent, parse_rate, parse_time

__all__ = ["TestbedConfig", "DEFAULT_NAME", "MAX_HOSTS"]

DEFAULT_NAME = "tb"
MAX_HOSTS = 250  # hosts get .1 .. .N of a /24
# What tc's tbf can hold (docs/testbed.md): below ~1.9kbit the 64 KiB bucket's drain time
# overflows the kernel's 32-bit tick count (1kbit got a 31190-byte bucket, 1bit a usage
# error); above ~3tbit the queue limit overflows 32 bits.
MIN_RATE_BPS, MAX_RATE_BPS = 10**4, 10**12
_NAME_RE = re.compile(r"[a-z0-9]{1,12}")


@dataclass(frozen=True, kw_only=True)
class TestbedConfig:
    """An emulated cluster: ``hosts`` Linux network namespaces on one switch.

    Every host has one full-duplex link to the switch that carries ``rate`` in each
    direction. ``delay`` is the one-way host-to-host latency added on top of the
    machine's own (a ping round trip grows by ``2 * delay``), ``jitter`` its random
    spread, and ``loss`` the probability that a packet is dropped between two hosts.
    See ``docs/testbed.md`` for how these map onto ``tc``.

    Args:
        hosts: number of hosts (namespaces), 1 to 250.
        rate: link rate per direction, e.g. ``"100mbit"``, ``"1gbit"``, ``"10gbit"``;
            10kbit to 1tbit.
        delay: one-way added latency, e.g. ``"0us"``, ``"50us"``, ``"1ms"``.
        jitter: spread of the added latency, e.g. ``"10us"``; needs ``delay``.
        loss: packet loss between two hosts, e.g. ``"0%"``, ``"0.1%"``.
        mtu: link MTU in bytes; 9000 (jumbo, as in many cloud VPCs) by default.
        name: testbed name, 1-12 of ``[a-z0-9]``; namespaces are ``so-<name>-h<i>``.
        subnet: an IPv4 ``/24`` (or larger) to number hosts from, or ``None`` to
            pick a private one not in use on this machine.

    Raises:
        ValueError: a field has the wrong form or range (the message names it).
        TypeError: a field has the wrong type.

    Example:
        >>> cfg = TestbedConfig(hosts=2, rate="1gbit", delay="50us")
        >>> cfg.rate_bps, cfg.delay_s
        (1000000000, 5e-05)
    """

    __test__ = False  # not a pytest class

    hosts: int
    rate: str
    delay: str = "0us"
    jitter: str = "0us"
    loss: str = "0%"
    mtu: int = 9000
    name: str = DEFAULT_NAME
    subnet: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or isinstance(self.hosts, bool):
            raise TypeError(f"hosts: expected an int, got {type(self.hosts).__name__} {self.hosts!r}")
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts: expected an integer from 1 to {MAX_HOSTS}, got {self.hosts}")
        if not MIN_RATE_BPS <= parse_rate(self.rate, field="rate") <= MAX_RATE_BPS:
            raise ValueError(f"rate: expected 10kbit to 1tbit (what tc's tbf shapes with this "
                             f"testbed's bucket and queue), got {self.rate!r}")
        delay = parse_time(self.delay, field="delay")
        jitter = parse_time(self.jitter, field="jitter")
        parse_percent(self.loss, field="loss")
        if jitter > 0 and jitter > delay:
            raise ValueError(
                f"jitter: expected at most the delay ({self.delay}) so latency stays "
                f"positive, got {self.jitter!r}"
            )
        if not isinstance(self.mtu, int) or isinstance(self.mtu, bool):
            raise TypeError(f"mtu: expected an int, got {type(self.mtu).__name__} {self.mtu!r}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu: expected 576 to 65535 bytes (1500 or 9000 are usual), got {self.mtu}")
        if not isinstance(self.name, str) or _NAME_RE.fullmatch(self.name) is None:
            raise ValueError(
                f"name: expected 1-12 lowercase letters or digits (e.g. {DEFAULT_NAME!r}), got {self.name!r}"
            )
        if self.subnet is not None:
            self._check_subnet(self.subnet)

    def _check_subnet(self, subnet: str) -> None:
        try:
            network = ipaddress.IPv4Network(subnet, strict=True)
        except (ValueError, TypeError) as err:
            raise ValueError(f"subnet: expected an IPv4 network such as '10.213.0.0/24', got {subnet!r}") from err
        if not network.is_private:
            raise ValueError(f"subnet: expected a private network (10/8, 172.16/12, 192.168/16), got {subnet!r}")
        if network.num_addresses - 2 < self.hosts:
            raise ValueError(
                f"subnet: expected room for {self.hosts} hosts, got {subnet!r} "
                f"with {network.num_addresses - 2} usable addresses"
            )

    @property
    def rate_bps(self) -> int:
        """The link rate per direction in bits per second."""
        return parse_rate(self.rate, field="rate")

    @property
    def delay_s(self) -> float:
        """The added one-way latency in seconds."""
        return parse_time(self.delay, field="delay")

    @property
    def jitter_s(self) -> float:
        """The spread of the added latency in seconds."""
        return parse_time(self.jitter, field="jitter")

    @property
    def loss_fraction(self) -> float:
        """The packet loss probability in [0, 1]."""
        return parse_percent(self.loss, field="loss")

    @property
    def needs_netem(self) -> bool:
        """Whether delay, jitter or loss is asked for (these need ``sch_netem``)."""
        return self.delay_s > 0 or self.jitter_s > 0 or self.loss_fraction > 0
