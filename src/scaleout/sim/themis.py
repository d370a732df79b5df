"""Themis-style scheduling of a chunked all-reduce across network dimensions.

An all-reduce of ``n`` bytes is cut into ``chunks`` pieces. Each chunk reduce-scatters
through every dimension in some order and all-gathers back through the reverse order; a
dimension serves one chunk phase at a time (ASTRA-sim's active-chunks-per-dimension = 1),
so phases of different chunks overlap on different dimensions.

* ``baseline``: every chunk uses the fixed order 0, 1, ..., N-1 (ASTRA-sim's hierarchical
  all-reduce).
* ``themis``: the scheduler keeps a running load per dimension; for each chunk it orders
  the dimensions least-loaded first, then charges them: a reduce-scatter of ``m`` bytes on a
  dimension of size ``d`` adds ``m (d-1)/d / B_d`` and shrinks the chunk to ``m/d``; the
  matching all-gather adds ``m (d-1) / B_d`` on the way back (Themis, ISCA'22; REFERENCES.md
  §5, with the load in seconds rather than relative to dimension 0's bandwidth). While the
  loads differ by less than 1/16 of a chunk (the gap converted to bytes on the least-loaded
  dimension) it keeps the fixed order, as ASTRA-sim's ``OfflineGreedy`` does.

Which waiting chunk phase a free dimension serves next is the intra-dimension policy
(ASTRA-sim's ``intra-dimension-scheduling``): ``fifo`` in arrival order; ``scf`` (smallest
chunk first, introduced with Themis in the same ISCA'22 paper) inserts a phase before the first
waiting phase at least as large (a phase's size is the larger of its input and output), except
a phase with exactly one phase left after it, which joins the back (ASTRA-sim's ``Sys.cc``,
``insert_stream`` under ``SmallestFirst``, tests ``phases_to_go.size() == 1`` after the current
phase was popped from that list). Without it a
Themis order stalls: every chunk's first phase, full-size, queues on its least-loaded
dimension at once, and the small later phases that would keep the other dimensions busy wait
behind them.

The gain reported is ``baseline time / themis time`` for the same bytes, i.e. the ratio of
all-reduce bandwidth utilisations (bytes carried / (time x the summed bandwidth of the
dimensions): every order moves the same bytes in all). :func:`themis_gain` compares Themis
with SCF, as the paper proposes it, against the baseline with FIFO (ASTRA-sim's defaults).

Example:
    >>> from scaleout.sim.network import parse_topology
    >>> topo = parse_topology("4x4", bandwidths=[1.0, 1.0], kinds=["ring", "ring"])
    >>> r = pipelined_allreduce(topo, nbytes=16.0, chunks=1, algorithm="ring")
    >>> r.time  # RS 3 x 16/4 on dim 0, RS 3 x 4/4 on dim 1, then the same back
    30.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scaleout.sim.collectives import phase_time
from scaleout.sim.events import EventQueue
from scaleout.sim.network import Topology

__all__ = ["SCHEDULERS", "INTRA", "MAX_CHUNKS", "PipelineResult", "pipelined_algorithm",
           "pipelined_allreduce", "themis_gain"]

SCHEDULERS = ("baseline", "themis")
INTRA = ("fifo", "scf")
#: The most chunks one all-reduce is cut into (Themis's paper uses 64; 10**5 took 25 s here).
MAX_CHUNKS = 4096


@dataclass(frozen=True, kw_only=True)
class PipelineResult:
    """A chunked multi-dimensional all-reduce.

    Attributes:
        scheduler: ``"baseline"`` or ``"themis"``.
        time: seconds until the last chunk finished.
        busy: per dimension, seconds its links carried bytes (``sent / bandwidth``).
        orders: per chunk, the dimension order it used.
    """

    scheduler: str
    time: float
    busy: tuple[float, ...]
    orders: tuple[tuple[int, ...], ...]

    def utilisation(self) -> tuple[float, ...]:
        """Per dimension, the fraction of the run its links carried bytes."""
        return tuple(b / self.time if self.time > 0 else 0.0 for b in self.busy)


def _orders(topology: Topology, nbytes: float, chunks: int, scheduler: str) -> list[list[int]]:
    active = [i for i, d in enumerate(topology.dims) if d.npus > 1]
    if scheduler == "baseline" or not active:  # (one NPU: no dimension to order, nothing sent)
        return [list(active) for _ in range(chunks)]
    load = {i: 0.0 for i in active}
    orders = []
    for _ in range(chunks):
        order = sorted(active, key=lambda i: (load[i], i))
        first, dim = order[0], topology.dims[order[0]]
        gap = (load[order[-1]] - load[first]) * dim.bandwidth * dim.npus / (dim.npus - 1)
        if gap < nbytes / chunks / 16:  # nearly balanced: keep the fixed order
            order = list(active)
        size = nbytes / chunks
        for i in order:  # reduce-scatter up
            d, bw = topology.dims[i].npus, topology.dims[i].bandwidth
            load[i] += size * (d - 1) / d / bw
            size /= d
        for i in reversed(order):  # all-gather back
            d, bw = topology.dims[i].npus, topology.dims[i].bandwidth
            load[i] += size * (d - 1) / bw
            size *= d
        orders.append(order)
    return orders


def pipelined_algorithm(algorithm: str | Sequence[str], flat: bool = False) -> str:
    """The one per-dimension algorithm of a pipelined all-reduce: ``algorithm``, or the name
    its per-dimension list repeats.

    Raises:
        ValueError: several different algorithms, or ``flat`` (a pipelined all-reduce runs
            the hierarchical phases, one dimension at a time).

    Example:
        >>> pipelined_algorithm(("ring", "ring"))
        'ring'
    """
    names = (algorithm,) if isinstance(algorithm, str) else tuple(algorithm)
    if len(set(names)) != 1 or flat:
        raise ValueError("a pipelined all-reduce takes one algorithm and no flat ring")
    return names[0]


def pipelined_allreduce(
    topology: Topology,
    *,
    nbytes: float,
    chunks: int = 64,
    algorithm: str = "ring",
    scheduler: str = "baseline",
    intra: str | None = None,
) -> PipelineResult:
    """Simulate a chunked all-reduce, every dimension serving one chunk phase at a time.

    Args:
        topology: the network.
        nbytes: all-reduce size per NPU.
        chunks: pieces it is cut into (ASTRA-sim's preferred-dataset-splits).
        algorithm: the per-dimension algorithm (``ring``, ``direct``, ``halving_doubling``).
        scheduler: ``"baseline"`` (fixed order) or ``"themis"``.
        intra: which waiting phase a dimension serves next: ``"fifo"`` or ``"scf"``;
            ``None``: the paper's pairing, FIFO for the baseline and SCF for Themis.

    Raises:
        ValueError: an unknown scheduler or intra policy, or a chunk count < 1 or above
            :data:`MAX_CHUNKS`.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    if intra is None:
        intra = "scf" if scheduler == "themis" else "fifo"
    if intra not in INTRA:
        raise ValueError(f"intra must be one of {INTRA}, got {intra!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be an int from 1 to {MAX_CHUNKS}, got {chunks!r}")
    orders = _orders(topology, float(nbytes), chunks, scheduler)
    dims = topology.dims
    busy = [0.0] * len(dims)
    free = [True] * len(dims)
    waiting: list[list[tuple[int, int]]] = [[] for _ in dims]  # per dim: (chunk, stage)
    stages = []  # per chunk: [(dim, op, bytes in)]
    for order in orders:
        size, plan = nbytes / chunks, []
        for i in order:
            plan.append((i, "reduce_scatter", size))
            size /= dims[i].npus
        for i in reversed(order):
            size *= dims[i].npus
            plan.append((i, "allgather", size))
        stages.append(plan)
    queue = EventQueue()
    finished = [0.0]

    def start(dim: int) -> None:
        if not free[dim] or not waiting[dim]:
            return
        chunk, stage = waiting[dim].pop(0)
        _, op, size = stages[chunk][stage]
        t, sent = phase_time(dims[dim], op, algorithm, size)
        free[dim] = False
        busy[dim] += sent / dims[dim].bandwidth
        queue.after(t, lambda: done(dim, chunk, stage))

    def enqueue(chunk: int, stage: int) -> None:
        if stage == len(stages[chunk]):
            finished[0] = max(finished[0], queue.now)
            return
        dim = stages[chunk][stage][0]
        queue_ = waiting[dim]
        at = len(queue_)
        if intra == "scf" and stage != len(stages[chunk]) - 2:  # see the module docstring
            mine = _phase_size(stages[chunk][stage])
            at = next(
                (k for k, (c, s) in enumerate(queue_)
                 if _phase_size(stages[c][s]) >= mine),
                at,
            )
        queue_.insert(at, (chunk, stage))
        start(dim)

    def done(dim: int, chunk: int, stage: int) -> None:
        free[dim] = True
        enqueue(chunk, stage + 1)
        start(dim)

    for chunk in range(chunks):
        enqueue(chunk, 0)
    queue.run()
    return PipelineResult(
        scheduler=scheduler,
        time=finished[0],
        busy=tuple(busy),
        orders=tuple(tuple(o) for o in orders),
    )


def _phase_size(stage: tuple[int, str, float]) -> float:
    """A phase's larger end: a reduce-scatter's input, an all-gather's output (as stored)."""
    return stage[2]


def themis_gain(
    topology: Topology, *, nbytes: float, chunks: int = 64, algorithm: str = "ring"
) -> tuple[float, PipelineResult, PipelineResult]:
    """``(baseline time / themis time, baseline result, themis result)``: the baseline in
    fixed order with FIFO dimensions, Themis with smallest-chunk-first ones."""
    base = pipelined_allreduce(
        topology, nbytes=nbytes, chunks=chunks, algorithm=algorithm, scheduler="baseline"
    )
    them = pipelined_allreduce(
        topology, nbytes=nbytes, chunks=chunks, algorithm=algorithm, scheduler="themis"
    )
    return (base.time / them.time if them.time > 0 else 1.0), base, them
