"""A measured data-parallel link, as the autotuner sees it (:class:`LinkModel`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaleout.scheduler.config import MB
from scaleout.sim.collectives import collective_cost
from scaleout.sim.network import Dimension, Topology
from scaleout.sim.units import format_bytes, format_time

__all__ = ["LinkModel"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """A measured data-parallel link: an all-reduce of ``m`` bytes over ``ranks`` ranks takes
    ``latency_s + m * seconds_per_byte``; each costs a rank ``cpu_s_per_message`` of CPU on
    the cores its compute uses, and ``cpu_s_per_byte`` more per byte it moves (gloo's threads
    and the kernel's TCP path; both measured on CPU runs; 0 where the compute has cores or a
    device of its own).

    Raises:
        ValueError: ranks < 1, or a negative / non-finite time.
    """

    ranks: int
    latency_s: float
    seconds_per_byte: float
    cpu_s_per_message: float = 0.0
    cpu_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks must be an int >= 1, got {self.ranks!r}")
        for name in ("latency_s", "seconds_per_byte", "cpu_s_per_message", "cpu_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def fit(cls, ranks: int, small: tuple[int, float], large: tuple[int, float]) -> LinkModel:
        """The line through two measured all-reduces ``(bytes, seconds)`` (clamped at >= 0).

        Raises:
            ValueError: the large size is not larger than the small one.
        """
        (m1, t1), (m2, t2) = small, large
        if not m2 > m1 >= 0:
            raise ValueError(f"the large probe must be larger than the small one, got {m1} and {m2}")
        per_byte = max((t2 - t1) / (m2 - m1), 0.0)
        return cls(ranks=ranks, latency_s=max(t1 - per_byte * m1, 0.0),
                   seconds_per_byte=per_byte)

    @property
    def bandwidth(self) -> float:
        """All-reduce bytes per second for large messages (``inf`` for a free link)."""
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte else math.inf

    def allreduce_s(self, nbytes: float) -> float:
        """Predicted seconds of one all-reduce of ``nbytes``."""
        return self.latency_s + nbytes * self.seconds_per_byte if self.ranks > 1 else 0.0

    def topology(self) -> Topology:
        """A one-dimension switch topology whose ring all-reduce matches this line."""
        def unit(bandwidth: float, latency: float) -> float:  # an all-reduce of 1 MB
            topo = Topology(dims=(Dimension(kind="switch", npus=max(self.ranks, 2),
                                            bandwidth=bandwidth, latency=latency),))
            return collective_cost(topo, op="allreduce", algorithm="ring", nbytes=MB).time

        per_latency = unit(1e30, 1.0)  # seconds per second of hop latency
        per_byte = unit(1.0, 0.0) / MB  # seconds per byte at 1 byte/s
        bandwidth = per_byte / self.seconds_per_byte if self.seconds_per_byte else 1e18
        return Topology(dims=(Dimension(kind="switch", npus=self.ranks, bandwidth=bandwidth,
                                        latency=self.latency_s / per_latency),))

    def describe(self) -> str:
        text = (f"{self.ranks} ranks, all-reduce {format_time(self.latency_s)} + "
                f"{format_bytes(self.bandwidth)}/s" if self.seconds_per_byte else
                f"{self.ranks} ranks, all-reduce {format_time(self.latency_s)}, no measurable "
                "per-byte cost")
        parts = [text]
        if self.cpu_s_per_message:
            parts.append(f"{format_time(self.cpu_s_per_message)} of CPU per collective")
        if self.cpu_s_per_byte:
            parts.append(f"{format_time(self.cpu_s_per_byte * MB)} of CPU per MiB moved")
        return ", ".join(parts)
