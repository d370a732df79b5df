"""Networks: multi-dimensional topologies priced by ASTRA-sim's analytical model.

A message of ``m`` bytes between two NPUs costs ``hops x latency + m / bandwidth`` on the
first dimension where their coordinates differ (NPU ids split into per-dimension
coordinates, dimension 0 varying fastest). Hops per dimension kind: ``ring`` the shorter
way round, ``fully_connected`` 1, ``switch`` 2 (NPU -> switch -> NPU). The model is
congestion-unaware, like ASTRA-sim's analytical backend.

Example:
    >>> topo = parse_topology("8x128", bandwidths=["300GB/s", "100Gbps"],
    ...                        latencies=["1us", "5us"], kinds=["switch", "switch"])
    >>> topo.npus
    1024
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from scaleout.sim.units import parse_bandwidth, parse_time

__all__ = ["KINDS", "MIN_BANDWIDTH", "Dimension", "Topology", "Preset", "PRESETS",
           "parse_topology", "preset"]

KINDS = ("ring", "fully_connected", "switch")
#: Bytes per second of the slowest link priced: 1 bit/s.
MIN_BANDWIDTH = 1 / 8


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One dimension of a topology.

    Attributes:
        kind: ``"ring"``, ``"fully_connected"`` or ``"switch"``.
        npus: NPUs along this dimension, >= 1.
        bandwidth: bytes per second of one NPU's link on this dimension (per direction), at
            least :data:`MIN_BANDWIDTH` (slower links price a message beyond any float).
        latency: seconds per hop.
        name: a label for reports (e.g. ``"nvlink"``).
    """

    kind: str
    npus: int
    bandwidth: float
    latency: float
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dimension kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.npus, bool) or not isinstance(self.npus, int) or self.npus < 1:
            raise ValueError(f"npus must be an int >= 1, got {self.npus!r}")
        if not isinstance(self.bandwidth, (int, float)) or not self.bandwidth >= MIN_BANDWIDTH:
            raise ValueError(f"bandwidth must be at least 1 bit/s ({MIN_BANDWIDTH} bytes/s), "
                             f"got {self.bandwidth!r} bytes/s")
        if not isinstance(self.latency, (int, float)) or self.latency < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency!r}")

    def hops(self, distance: int = 1) -> int:
        """Hops between two NPUs ``distance`` apart along this dimension."""
        if self.kind == "switch":
            return 2
        if self.kind == "fully_connected":
            return 1
        distance %= self.npus
        return min(distance, self.npus - distance)

    def message_time(self, nbytes: float, distance: int = 1) -> float:
        """``hops x latency + nbytes / bandwidth`` for one message."""
        return self.hops(distance) * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Dimensions, innermost (fastest varying NPU id) first.

    Raises:
        ValueError: no dimension, or an element that is not a :class:`Dimension`.
    """

    dims: tuple[Dimension, ...]

    def __post_init__(self) -> None:
        if not self.dims or not all(isinstance(d, Dimension) for d in self.dims):
            raise ValueError(f"a topology needs at least one Dimension, got {self.dims!r}")

    @property
    def npus(self) -> int:
        """NPUs in all (the product of the dimensions)."""
        total = 1
        for dim in self.dims:
            total *= dim.npus
        return total

    @property
    def shape(self) -> str:
        """``"8x128"``: NPUs per dimension, innermost first."""
        return "x".join(str(d.npus) for d in self.dims)

    def coords(self, npu: int) -> tuple[int, ...]:
        """Per-dimension coordinates of ``npu`` (dimension 0 varies fastest)."""
        if not 0 <= npu < self.npus:
            raise ValueError(f"npu must be in [0, {self.npus}), got {npu}")
        out = []
        for dim in self.dims:
            out.append(npu % dim.npus)
            npu //= dim.npus
        return tuple(out)

    def message_time(self, src: int, dst: int, nbytes: float) -> float:
        """Cost of one message: on the first dimension where ``src`` and ``dst`` differ."""
        for dim, a, b in zip(self.dims, self.coords(src), self.coords(dst)):
            if a != b:
                return dim.message_time(nbytes, b - a)
        return 0.0

    def with_npus(self, npus: int) -> Topology:
        """The same kinds of dimension grown (or shrunk) along the outermost one to ``npus``.

        Inner dimensions are filled first (``8x128`` resized to 4 is 4 NPUs of one node, to 24
        three full nodes): each takes ``gcd(its size, what is left)``; the outermost dimension
        takes the rest.

        Raises:
            ValueError: ``npus`` < 1.
        """
        if isinstance(npus, bool) or not isinstance(npus, int) or npus < 1:
            raise ValueError(f"npus must be an int >= 1, got {npus!r}")
        dims, left = [], npus
        for dim in self.dims[:-1]:
            size = math.gcd(dim.npus, left)
            dims.append(_resized(dim, size))
            left //= size
        dims.append(_resized(self.dims[-1], left))
        return Topology(
            dims=tuple(dims)
        )  # size-1 dimensions stay, so per-dimension settings line up

    def describe(self) -> str:
        """One line per dimension for reports: ``8 switch@100Gbps/5us x ...``."""
        return " x ".join(
            f"{d.npus} {d.kind}@{d.bandwidth * 8 / 1e9:g}Gbps/{d.latency * 1e6:g}us"
            for d in self.dims
        )


def _resized(dim: Dimension, npus: int) -> Dimension:
    return Dimension(
        kind=dim.kind, npus=npus, bandwidth=dim.bandwidth, latency=dim.latency, name=dim.name
    )


def _per_dim(values: Sequence | str | float, count: int, what: str) -> list:
    if isinstance(values, (str, int, float)):
        values = [values]
    values = list(values)
    if len(values) == 1:
        values = values * count
    if len(values) != count:
        want = "1" if count == 1 else f"1 or {count}"  # (not "1 or 1")
        raise ValueError(f"expected {want} {what} (one per dimension), got {len(values)}")
    return values


def parse_topology(
    spec: str,
    *,
    bandwidths: Sequence | str | float,
    latencies: Sequence | str | float = "0us",
    kinds: Sequence[str] | str = "ring",
) -> Topology:
    """A topology from ``"8x128"`` and per-dimension bandwidths, latencies and kinds.

    Args:
        spec: NPUs per dimension, innermost first, joined by ``x``.
        bandwidths: one for all dimensions or one each (``"100Gbps"``, ``"400GB/s"``).
        latencies: likewise (``"5us"``).
        kinds: likewise (``"ring"``, ``"fully_connected"``, ``"switch"``).

    Raises:
        ValueError: a malformed spec, or lists whose length is neither 1 nor the dimensions'.
    """
    parts = spec.lower().split("x") if isinstance(spec, str) else []
    if not parts or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(
            f"topology must look like '8' or '8x128' (NPUs per dimension), got {spec!r}"
        )
    sizes = [int(p) for p in parts]
    bws = _per_dim(bandwidths, len(sizes), "bandwidths")
    lats = _per_dim(latencies, len(sizes), "latencies")
    kinds_ = _per_dim(kinds, len(sizes), "kinds")
    return Topology(
        dims=tuple(
            Dimension(
                kind=k.replace("-", "_"),
                npus=n,
                bandwidth=parse_bandwidth(b),
                latency=parse_time(lat),
            )
            for n, b, lat, k in zip(sizes, bws, lats, kinds_)
        )
    )


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A named cluster: its topology at full size and where the figures come from.

    Attributes:
        name: the preset's key.
        topology: the whole machine.
        source: citation of every figure used.
    """

    name: str
    topology: Topology
    source: str


def _preset(name: str, spec: str, bws: list, lats: list, kinds: list, source: str) -> Preset:
    return Preset(
        name=name,
        source=source,
        topology=parse_topology(spec, bandwidths=bws, latencies=lats, kinds=kinds),
    )


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            _preset(
                "hgx-h100",
                "8",
                ["400GB/s"],
                ["936.25ns"],
                ["switch"],
                "ASTRA-sim's validated HGX-H100 network config (REFERENCES.md §5)",
            ),
            _preset(
                "horovod-pascal",
                "4x128",
                ["10GB/s", "25Gbps"],
                ["5us", "5us"],
                ["ring", "switch"],
                "Horovod paper: 128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE (REFERENCES.md §2); "
                "intra-server PCIe 3 x16 ~10 GB/s and 5 us per hop are our assumptions",
            ),
            _preset(
                "goyal-bigbasin",
                "8x32",
                ["20GB/s", "6.25Gbps"],
                ["2us", "5us"],
                ["ring", "switch"],
                "Goyal et al. 2017: 32 Big Basin servers x 8 P100 (NVLink), one Mellanox "
                "ConnectX-4 50 Gbit/s Ethernet card per server (REFERENCES.md §2): a link here "
                "is one NPU's, so the 8 GPUs' share is 50/8 Gbit/s each; NVLink ring ~20 GB/s "
                "per direction assumed",
            ),
            _preset(
                "knl-omnipath",
                "256",
                ["100Gbps"],
                ["1us"],
                ["switch"],
                "Intel Caffe + MLSL on 256 Xeon Phi 7250 nodes over Omni-Path 100 Gbit/s "
                "(seeds/003, REFERENCES.md §2); 1 us switch hop assumed",
            ),
            _preset(
                "marenostrum4",
                "256",
                ["100Gbps"],
                ["1us"],
                ["switch"],
                "MareNostrum 4: Xeon Platinum 8160 nodes, Omni-Path 100 Gbit/s (REFERENCES.md §2)",
            ),
            _preset(
                "dgx-ethernet",
                "8x128",
                ["300GB/s", "100Gbps"],
                ["1us", "5us"],
                ["switch", "switch"],
                "issue 13's example: 8 GPUs on NVLink x 128 nodes on 100 Gbit Ethernet",
            ),
        )
    }
)


def preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown network preset {name!r}; known: {', '.join(PRESETS)}") from None
