"""Collective algorithms priced on a topology (alpha-beta per dimension, ASTRA-sim style).

Per dimension of ``p`` NPUs, with ``a`` its latency, ``h(k)`` the hops to a peer ``k`` apart,
``B`` its bandwidth and ``n`` the bytes entering the phase (REFERENCES.md §3, no reduction
cost: gamma = 0):

=====================  ================================================================
ring                   reduce-scatter / all-gather: ``(p-1) (h(1) a + n/(p B))``;
                       all-reduce twice that; all-to-all ``sum_k h(k) a + (p-1) n/(p B)``
direct                 one round of ``p-1`` messages of ``n/p``: parallel links on a fully
                       connected dimension (``a + n/(p B)``), one NIC otherwise
                       (``max h a + (p-1) n/(p B)``); all-reduce = RS + AG; broadcast the
                       same round with messages of ``n`` (``a + n/B`` fully connected)
halving_doubling       Rabenseifner: ``sum_k h(p/2^(k+1)) a + n/2^(k+1) B^-1`` per half,
                       ``2 lg p a + 2 (p-1)/p n/B`` on a switch; a non-power-of-two ``p``
                       adds one full-size exchange per half (fold-in / fold-out); broadcast
                       binomial ``sum_k h(2^k) a + ceil(lg p) n/B``, all-to-all Bruck
                       ``sum_k h(2^k) a + ceil(lg p) n/(2B)`` (k < ceil(lg p))
double_binary_tree     all-reduce ``2 sum_k h(2^k) a + 2 n/B`` (NCCL's pipelined trees:
                       every node sends 2n in all; level k of ASTRA-sim's in-order tree
                       links NPUs 2^k apart, k < ceil(lg p)); broadcast ``sum_k h(2^k) a +
                       n/B``;
                       other ops run as rings (as NCCL does) and are labelled ``ring``
=====================  ================================================================

On several dimensions the collective is hierarchical (ASTRA-sim's localBWAware): an
all-reduce reduce-scatters up dimensions 0..N-2, all-reduces the 1/prod-sized piece on
dimension N-1, then all-gathers back down (a tree's inner reduce-scatter / all-gather
phases run as rings, as NCCL's tree algorithm chains the GPUs of a node); ``flat=True``
instead runs one ring over every NPU at the slowest dimension's speed (what a framework that
ignores the hierarchy does).

Example:
    >>> from scaleout.sim.network import parse_topology
    >>> topo = parse_topology("4", bandwidths=[1.0], latencies=[0.0], kinds=["ring"])
    >>> collective_cost(topo, op="allreduce", algorithm="ring", nbytes=4.0).time
    6.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scaleout.sim.network import Dimension, Topology

__all__ = [
    "OPS", "ALGORITHMS", "Phase", "CollectiveCost", "bus_factor", "phase_time", "collective_cost",
]

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")
ALGORITHMS = ("ring", "direct", "halving_doubling", "double_binary_tree")
_BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
}


def bus_factor(op: str, npus: int) -> float:
    """busbw / algbw of ``op`` on ``npus`` NPUs (nccl-tests): 2(p-1)/p for all-reduce, (p-1)/p
    for reduce-scatter, all-gather and all-to-all, 1 for broadcast.

    Raises:
        ValueError: an op not in :data:`OPS`.
    """
    if op not in _BUS_FACTOR:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return _BUS_FACTOR[op](npus)


@dataclass(frozen=True)
class Phase:
    """One dimension's part of a collective.

    Attributes:
        dim: the dimension's index.
        op: what runs on it (``"reduce_scatter"``, ``"allreduce"``, ...).
        start, end: seconds from the collective's start.
        nbytes: bytes entering the phase (per NPU).
        sent: bytes each NPU puts on that dimension's links.
    """

    dim: int
    op: str
    start: float
    end: float
    nbytes: float
    sent: float


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """The price of one collective.

    Attributes:
        op, algorithm: what was priced.
        nbytes: the collective's size (per NPU input for all-reduce and friends).
        npus: NPUs taking part.
        time: seconds.
        phases: the per-dimension timeline.
        link_busy: per dimension, seconds its links carried bytes (``sent / bandwidth``).
    """

    op: str
    algorithm: str
    nbytes: float
    npus: int
    time: float
    phases: tuple[Phase, ...]
    link_busy: tuple[float, ...]

    @property
    def algbw(self) -> float:
        """Bytes per second, nccl-tests' algorithm bandwidth (size / time); 0 when the
        collective takes no time (0 bytes, or one NPU: nothing crosses a link), never inf."""
        return self.nbytes / self.time if self.time > 0 else 0.0

    @property
    def busbw(self) -> float:
        """nccl-tests' bus bandwidth (algbw x the op's correction factor; 0 when algbw is)."""
        return self.algbw * bus_factor(self.op, self.npus)

    def utilisation(self) -> tuple[float, ...]:
        """Per dimension, the fraction of the collective's time its links were busy."""
        return tuple(b / self.time if self.time > 0 else 0.0 for b in self.link_busy)


def _check(op: str, algorithm: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "double_binary_tree" and op not in ("allreduce", "broadcast"):
        raise ValueError(f"double_binary_tree prices allreduce and broadcast, got op {op!r}")


def _halving(dim: Dimension, n: float) -> tuple[float, float]:
    """One half (reduce-scatter or all-gather) of Rabenseifner: (time, bytes sent)."""
    p = dim.npus
    q = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    time, sent = 0.0, 0.0
    if q != p:  # fold the extra ranks in (or out): one full-size exchange
        time += dim.message_time(n, q % p or 1)
        sent += n
    distance, size = q // 2, n / 2
    while distance >= 1:
        time += dim.message_time(size, distance)
        sent += size
        distance //= 2
        size /= 2
    return time, sent


def phase_time(dim: Dimension, op: str, algorithm: str, nbytes: float) -> tuple[float, float]:
    """One collective on one dimension: ``(seconds, bytes each NPU sends)``.

    Args:
        dim: the dimension.
        op: one of :data:`OPS`.
        algorithm: one of :data:`ALGORITHMS`.
        nbytes: bytes per NPU entering the phase (the full vector for reduce-scatter and
            all-reduce; the gathered result for all-gather; the total each NPU sends for
            all-to-all; the message for broadcast).

    Raises:
        ValueError: an unknown op or algorithm, or a pair that is not priced.
    """
    _check(op, algorithm)
    p, n = dim.npus, float(nbytes)
    if p == 1 or n <= 0:
        return 0.0, 0.0
    a, B = dim.latency, dim.bandwidth
    if op == "allreduce" and algorithm != "double_binary_tree":
        t1, s1 = phase_time(dim, "reduce_scatter", algorithm, n)
        t2, s2 = phase_time(dim, "allgather", algorithm, n)
        return t1 + t2, s1 + s2
    if algorithm == "double_binary_tree":  # (before stop 52 a level paid h(1): 6a, not 14a,
        factor = 2 if op == "allreduce" else 1  # for an all-reduce on a ring of 8)
        return factor * _tree_hops(dim) * a + factor * n / B, factor * n
    if op == "broadcast":
        if algorithm == "halving_doubling":  # binomial tree: step k reaches peers 2^k away
            depth = (p - 1).bit_length()
            return _tree_hops(dim) * a + depth * n / B, depth * n
        if algorithm == "direct":  # the root sends p-1 copies in one round, as direct does
            return _direct(dim, n)
        t, s = phase_time(dim, "allgather", "ring", n)  # scatter + ring all-gather
        return 2 * t, 2 * s
    if op == "alltoall":
        if algorithm == "halving_doubling":  # Bruck: step k sends n/2 to the peer 2^k away
            steps = (p - 1).bit_length()
            hops = sum(dim.hops(1 << k) for k in range(steps))
            return hops * a + steps * n / 2 / B, steps * n / 2
        piece = n / p
        if algorithm == "ring":
            return sum(dim.hops(k) for k in range(1, p)) * a + (p - 1) * piece / B, (p - 1) * piece
        return _direct(dim, piece)
    # reduce_scatter / allgather: the same traffic, mirrored
    if algorithm == "ring":
        return (p - 1) * dim.message_time(n / p), (p - 1) * n / p
    if algorithm == "direct":
        return _direct(dim, n / p)
    return _halving(dim, n)


def _tree_hops(dim: Dimension) -> int:
    """Hops down one root-to-leaf path of a tree of ``ceil(lg p)`` levels whose level ``k``
    joins NPUs ``2^k`` apart: a binomial tree's steps, and ASTRA-sim's ``BinaryTree`` (NPUs
    numbered in order, so a node of height k+1 has its children 2^k away). On a ring of 8:
    h(1) + h(2) + h(4) = 7, at least the p/2 = 4 hops to the farthest NPU from the root."""
    return sum(dim.hops(1 << k) for k in range((dim.npus - 1).bit_length()))


def _direct(dim: Dimension, piece: float) -> tuple[float, float]:
    p = dim.npus
    sent = (p - 1) * piece
    if dim.kind == "fully_connected":  # one link per peer, all at once
        return dim.latency + piece / dim.bandwidth, sent
    hops = max(dim.hops(k) for k in range(1, p)) if dim.kind == "ring" else dim.hops(1)
    return hops * dim.latency + sent / dim.bandwidth, sent


def _ran(op: str, algos: list[str]) -> list[str]:
    """The algorithms that price ``op``: a tree asked for an op it does not price runs as a
    ring (NCCL's fallback), and says so (it was reported as ``double_binary_tree``)."""
    if op in ("allreduce", "broadcast"):
        return algos
    return ["ring" if name == "double_binary_tree" else name for name in algos]


def _algorithms(algorithm: str | Sequence[str], count: int) -> list[str]:
    names = [algorithm] * count if isinstance(algorithm, str) else list(algorithm)
    if len(names) != count:
        raise ValueError(f"expected one algorithm or one per dimension ({count}), got {names}")
    return names


def collective_cost(
    topology: Topology,
    *,
    op: str,
    algorithm: str | Sequence[str],
    nbytes: float,
    flat: bool = False,
) -> CollectiveCost:
    """Price one collective over every NPU of ``topology``.

    Args:
        topology: the network.
        op: one of :data:`OPS`.
        algorithm: one of :data:`ALGORITHMS`, or one per dimension.
        nbytes: bytes per NPU (see :func:`phase_time`); 0 means nothing to move, a collective
            that is skipped and costs 0 s (the smallest that runs, 1 byte, pays every step's
            latency). Its :attr:`~CollectiveCost.algbw` is then 0, as on one NPU.
        flat: one ring over all NPUs at the slowest dimension's speed instead of the
            hierarchical decomposition (``algorithm`` must then be ``"ring"``).

    Returns:
        Its time, per-dimension timeline and link busy times.

    Raises:
        ValueError: a bad op, algorithm or size.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not (
        0 <= nbytes < math.inf
    ):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    dims = topology.dims
    algos = _algorithms(algorithm, len(dims))
    for name in algos:
        _check(op if name != "double_binary_tree" else "allreduce", name)
    busy = [0.0] * len(dims)
    if flat:
        return _flat(topology, op, algos, float(nbytes), busy)
    active = [i for i, d in enumerate(dims) if d.npus > 1]
    plan: list[tuple[int, str, float]] = []  # (dim, op, bytes entering)
    size = float(nbytes)
    if op == "allreduce" and active:
        up = []
        for i in active[:-1]:
            up.append((i, "reduce_scatter", size))
            size /= dims[i].npus
        plan = (
            up
            + [(active[-1], "allreduce", size)]
            + [(i, "allgather", s) for i, _, s in reversed(up)]
        )
    elif op == "reduce_scatter":
        for i in active:
            plan.append((i, op, size))
            size /= dims[i].npus
    elif op == "allgather":
        total = 1
        for i in active:
            total *= dims[i].npus
        size = float(nbytes) / total
        for i in active:
            size *= dims[i].npus
            plan.append((i, op, size))
    else:  # broadcast, all-to-all: every dimension carries the whole message in turn
        plan = [(i, op, size) for i in active]
    phases, clock = [], 0.0
    for i, phase_op, size in plan:
        name = algos[i]
        if name == "double_binary_tree" and phase_op not in ("allreduce", "broadcast"):
            name = "ring"  # trees span the last dimension; inner halves run as rings (NCCL)
        t, sent = phase_time(dims[i], phase_op, name, size)
        phases.append(Phase(dim=i, op=phase_op, start=clock, end=clock + t, nbytes=size, sent=sent))
        busy[i] += sent / dims[i].bandwidth
        clock += t
    return CollectiveCost(
        op=op,
        algorithm="+".join(dict.fromkeys(_ran(op, algos))),
        nbytes=float(nbytes),
        npus=topology.npus,
        time=clock,
        phases=tuple(phases),
        link_busy=tuple(busy),
    )


def _flat(
    topology: Topology, op: str, algos: list[str], nbytes: float, busy: list[float]
) -> CollectiveCost:
    if set(algos) != {"ring"}:
        raise ValueError(
            f"flat=True prices one ring over all NPUs; algorithm must be 'ring', got {algos}"
        )
    active = [d for d in topology.dims if d.npus > 1] or list(topology.dims)
    slowest = min(active, key=lambda d: d.bandwidth)
    ring = Dimension(
        kind="ring",
        npus=topology.npus,
        bandwidth=slowest.bandwidth,
        latency=max(d.latency for d in active) * max(d.hops(1) for d in active),
    )
    t, sent = phase_time(ring, op, "ring", nbytes)
    for i, dim in enumerate(topology.dims):
        if dim.npus > 1:
            busy[i] = sent / dim.bandwidth
    return CollectiveCost(
        op=op,
        algorithm="flat-ring",
        nbytes=nbytes,
        npus=topology.npus,
        time=t,
        phases=(
            Phase(
                dim=topology.dims.index(slowest), op=op, start=0.0, end=t, nbytes=nbytes, sent=sent
            ),
        ),
        link_busy=tuple(busy),
    )
