"""Bus bandwidth of this machine's testbed collectives: measured by ``bench collectives``, predicted.

What is predicted: the bus bandwidth (nccl-tests convention, the bench's own) of every cell of
``scaleout bench collectives`` on the testbed (benchmarks/results/collectives-testbed-*-stop24.json,
commands in benchmarks/RESULTS.md §1): 2 and 3 ranks at 1 Gbit/s and 2 ranks at 100 Mbit/s,
allreduce, reduce_scatter, allgather, bcast and alltoall, 1 MB to 64 MB, each twice: scaleout's
collective (``ours``) and torch's gloo collective (``torch``), timed in the same run.

What goes in, and nothing else:

* the link: the ``tc`` rate x 0.98 and 50 us per hop through the bridge (a switch), as
  :mod:`scaleout.sim.testbed_cases` had it until stop 25. The 0.98 is the training split:
  the 2-rank 1 Gbit/s allreduce (RESULTS.md §1, stop 6: 0.122 GB/s), so those cells are not scored here;
* each op as the code really runs it, read from its source (not from these numbers):
  :data:`GLOO` for torch's collectives, :func:`scaleout_path` for scaleout's (which takes
  its receive-first exchange, ``scaleout.core.pairwise``, for blocks of at least
  :data:`EXCHANGE_MIN_BLOCK`, and gloo's collective below; a small all-reduce, none of the
  measured cells, as one all-to-all, ``scaleout.core.direct``). Where gloo posts a ``send``
  before the ``recv`` on a pair that carries data both ways (all-to-all; the all-gather
  ring at 2 ranks), and for scaleout's exchange, the cell is priced by
  :mod:`scaleout.sim.gloo_pairs`, gloo's recv-ready protocol as a fluid model; the rest by
  the alpha-beta formulas.
"""

from __future__ import annotations

from types import MappingProxyType

from scaleout.sim.collectives import bus_factor, collective_cost
from scaleout.sim.gloo_pairs import call_time
from scaleout.sim.network import parse_topology
from scaleout.sim.validation import Scenario

__all__ = ["DIRECT_MAX_BYTES", "EXCHANGE_MIN_BLOCK", "GLOO", "IMPLEMENTATIONS", "MEASURED",
           "LINK_EFFICIENCY", "predicted_busbw", "scaleout_path", "collective_scenarios"]

LINK_EFFICIENCY = 0.98  # bus bandwidth / tc rate, the 2-rank 1 Gbit/s allreduce (training split)
HOP_LATENCY = "50us"
RELATIVE_BOUND = 0.15
RATES = MappingProxyType({"100mbit": 100e6 / 8, "1gbit": 1e9 / 8})
IMPLEMENTATIONS = ("scaleout", "torch")

# bench op -> (the simulator's op, algorithm, where the backend says so). torch on CPU = gloo.
# Algorithm "gloo_pairs": gloo's own posting order through its recv-ready protocol
# (scaleout.sim.gloo_pairs), not a textbook cost.
GLOO = MappingProxyType({
    "allreduce": ("allreduce", "ring", "gloo ring all-reduce (gloo/allreduce.cc)"),
    "reduce_scatter": (
        "allreduce",
        "ring",
        "torch ProcessGroupGloo::reduce_scatter_tensor_coalesced all-reduces the whole input "
        "and copies out its chunk: it moves an all-reduce's bytes, not a reduce-scatter's",
    ),
    "allgather": ("allgather", "gloo_pairs",
                  "gloo/allgather.cc: a ring, p-1 steps of n/p in two halves, send(right) "
                  "posted before recv(left); at 2 ranks right = left, so one direction of the "
                  "pair can wait for the other (gloo's recv-ready protocol, sim/gloo_pairs.py)"),
    "bcast": ("broadcast", "halving_doubling",
              "gloo/broadcast.cc: binomial tree, every step the whole buffer"),
    "alltoall": ("alltoall", "gloo_pairs",
                 "gloo/alltoall.cc: p-1 pairwise sends of n/p posted at once, each send(rank+i) "
                 "before recv(rank-i): a late rank's recv-ready leaves behind its data, so "
                 "each pair's two directions run one after the other (sim/gloo_pairs.py)"),
})
_SIM_NAME = MappingProxyType({"bcast": "broadcast"})  # the bench's op names -> the simulator's

#: ``scaleout.core.pairwise.MIN_BLOCK_BYTES`` (the simulator imports only the scheduler; a
#: test checks the two agree): the smallest block per peer scaleout sends through its exchange.
EXCHANGE_MIN_BLOCK = 256 * 1024
_EXCHANGE = ("exchange", "scaleout.core.pairwise.exchange_blocks: every receive posted before "
             "any send, blocks of n/p to each peer; both directions of a pair at once "
             "(sim/gloo_pairs.py, exchange_program)")


#: ``scaleout.core.direct.MAX_BYTES`` (a test checks they agree): by group size, the largest
#: tensor scaleout all-reduces in one all-to-all of ``ranks`` copies of it (gloo's).
DIRECT_MAX_BYTES = MappingProxyType({2: 96 * 1024, 3: 16 * 1024})
_DIRECT = ("scaleout.core.direct: every rank's whole tensor to every other rank in one "
           "all-to-all ((p-1) n out of each rank), reduced locally; ")


def scaleout_path(op: str, ranks: int, nbytes: int) -> tuple[str, str, str]:
    """(the simulator's op, algorithm, why) of scaleout's collective ``op`` on CPU tensors of
    a gloo group, as ``scaleout.core.collectives`` chooses: a small all-reduce
    (:data:`DIRECT_MAX_BYTES`) as gloo's all-to-all of ``ranks`` copies of it (priced so by
    :func:`predicted_busbw`); all-to-all and reduce-scatter (any group size) and all-gather
    (2 ranks) through the receive-first exchange when each peer's block (``nbytes / ranks``)
    is at least :data:`EXCHANGE_MIN_BLOCK`; otherwise gloo's collective (:data:`GLOO`)."""
    if op == "allreduce" and nbytes <= DIRECT_MAX_BYTES.get(ranks, -1):
        return ("alltoall", GLOO["alltoall"][1], _DIRECT + GLOO["alltoall"][2])
    exchanged = ("alltoall", "reduce_scatter") + (("allgather",) if ranks == 2 else ())
    if op in exchanged and nbytes / ranks >= EXCHANGE_MIN_BLOCK:
        return ("alltoall", *_EXCHANGE)
    return GLOO[op]


# (ranks, rate, op, bytes, median ms of scaleout's call, of torch's): the JSON files' time_s
# and torch_time_s (benchmarks/results/collectives-testbed-*-stop24.json), the training split
# (2 ranks, 1 Gbit/s, allreduce) left out.
MEASURED = (
    (2, "1gbit", "reduce_scatter", 1048576, 4.61, 9.01),
    (2, "1gbit", "reduce_scatter", 4194304, 20.46, 38.95),
    (2, "1gbit", "reduce_scatter", 16777216, 72.53, 149.31),
    (2, "1gbit", "reduce_scatter", 67108864, 278.54, 593.26),
    (2, "1gbit", "allgather", 1048576, 4.54, 5.58),
    (2, "1gbit", "allgather", 4194304, 17.08, 25.69),
    (2, "1gbit", "allgather", 16777216, 70.49, 104.53),
    (2, "1gbit", "allgather", 67108864, 283.25, 439.69),
    (2, "1gbit", "bcast", 1048576, 8.34, 8.34),
    (2, "1gbit", "bcast", 4194304, 33.52, 33.50),
    (2, "1gbit", "bcast", 16777216, 135.05, 134.91),
    (2, "1gbit", "bcast", 67108864, 540.57, 540.52),
    (2, "1gbit", "alltoall", 1048576, 4.82, 6.73),
    (2, "1gbit", "alltoall", 4194304, 17.56, 24.81),
    (2, "1gbit", "alltoall", 16777216, 73.16, 134.98),
    (2, "1gbit", "alltoall", 67108864, 273.04, 544.34),
    (3, "1gbit", "allreduce", 1048572, 11.41, 11.27),
    (3, "1gbit", "allreduce", 4194300, 45.27, 45.89),
    (3, "1gbit", "allreduce", 16777212, 180.83, 180.50),
    (3, "1gbit", "allreduce", 67108860, 724.51, 725.58),
    (3, "1gbit", "reduce_scatter", 1048572, 6.99, 12.02),
    (3, "1gbit", "reduce_scatter", 4194300, 27.64, 48.60),
    (3, "1gbit", "reduce_scatter", 16777212, 98.33, 192.80),
    (3, "1gbit", "reduce_scatter", 67108860, 377.95, 815.86),
    (3, "1gbit", "allgather", 1048572, 7.38, 5.99),
    (3, "1gbit", "allgather", 4194300, 24.58, 23.87),
    (3, "1gbit", "allgather", 16777212, 97.90, 97.13),
    (3, "1gbit", "allgather", 67108860, 407.68, 411.78),
    (3, "1gbit", "bcast", 1048572, 16.61, 16.71),
    (3, "1gbit", "bcast", 4194300, 67.41, 67.30),
    (3, "1gbit", "bcast", 16777212, 270.53, 270.12),
    (3, "1gbit", "bcast", 67108860, 1081.71, 1081.38),
    (3, "1gbit", "alltoall", 1048572, 6.57, 7.35),
    (3, "1gbit", "alltoall", 4194300, 25.39, 35.43),
    (3, "1gbit", "alltoall", 16777212, 98.34, 131.79),
    (3, "1gbit", "alltoall", 67108860, 377.20, 527.82),
    (2, "100mbit", "allreduce", 1048576, 84.03, 84.33),
    (2, "100mbit", "allreduce", 4194304, 338.80, 342.61),
    (2, "100mbit", "allreduce", 16777216, 1416.21, 1353.23),
    (2, "100mbit", "reduce_scatter", 1048576, 44.10, 84.18),
    (2, "100mbit", "reduce_scatter", 4194304, 168.68, 345.11),
    (2, "100mbit", "reduce_scatter", 16777216, 701.45, 1369.35),
    (2, "100mbit", "allgather", 1048576, 41.90, 53.29),
    (2, "100mbit", "allgather", 4194304, 170.67, 264.05),
    (2, "100mbit", "allgather", 16777216, 688.15, 1063.96),
    (2, "100mbit", "bcast", 1048576, 84.09, 84.10),
    (2, "100mbit", "bcast", 4194304, 337.48, 337.56),
    (2, "100mbit", "bcast", 16777216, 1351.75, 1351.79),
    (2, "100mbit", "alltoall", 1048576, 41.90, 74.41),
    (2, "100mbit", "alltoall", 4194304, 176.78, 328.38),
    (2, "100mbit", "alltoall", 16777216, 676.23, 1344.36),
)


def _bus(op: str, ranks: int) -> float:
    """busbw / algbw of a bench op, by its own name (a reduce_scatter's factor, whatever gloo
    moves for it): what ``bench collectives`` reports."""
    return bus_factor(_SIM_NAME.get(op, op), ranks)


def predicted_busbw(op: str, ranks: int, rate: str, nbytes: int,
                    implementation: str = "torch") -> float:
    """The bus bandwidth (bytes/s) the simulator predicts for one bench cell: torch's gloo
    collective (:data:`GLOO`) or scaleout's (:func:`scaleout_path`).

    Raises:
        ValueError: an op not in :data:`GLOO`, a rate not in ``RATES`` or an implementation
            not in :data:`IMPLEMENTATIONS`.
    """
    if op not in GLOO:
        raise ValueError(f"op must be one of {', '.join(GLOO)}, got {op!r}")
    if rate not in RATES:
        raise ValueError(f"rate must be one of {', '.join(RATES)}, got {rate!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    path = GLOO[op] if implementation == "torch" else scaleout_path(op, ranks, nbytes)
    sim_op, algorithm, _ = path
    topology = parse_topology(str(ranks), bandwidths=[RATES[rate] * LINK_EFFICIENCY],
                              latencies=[HOP_LATENCY], kinds=["switch"])
    if algorithm in ("gloo_pairs", "exchange"):
        dim = topology.dims[0]
        moved = nbytes * ranks if op == "allreduce" else nbytes  # (direct: ranks copies)
        time = call_time(sim_op if algorithm == "gloo_pairs" else "exchange", ranks, moved,
                         bandwidth=dim.bandwidth, latency=dim.hops() * dim.latency)
    else:
        time = collective_cost(topology, op=sim_op, algorithm=algorithm, nbytes=nbytes).time
    return nbytes / time * _bus(op, ranks)


def collective_scenarios() -> tuple[Scenario, ...]:
    """Two scenarios per measured cell, scaleout's call (named op size ranks rate) and
    torch's (torch op ...): bus bandwidth in GB/s, within 15%."""
    out = []
    for ranks, rate, op, nbytes, *times in MEASURED:
        for implementation, ms in zip(IMPLEMENTATIONS, times):
            path = GLOO[op] if implementation == "torch" else scaleout_path(op, ranks, nbytes)
            prefix = "torch " if implementation == "torch" else ""
            out.append(Scenario(
                name=f"{prefix}{op} {nbytes / 2**20:.0f}MB {ranks} ranks {rate}",
                group="collectives",
                measured=nbytes / (ms / 1e3) * _bus(op, ranks) / 1e9,
                unit="GB/s",
                bound=RELATIVE_BOUND,
                source=(f"bench collectives ({implementation}), benchmarks/results/"
                        f"collectives-testbed-{ranks}r-{rate}-stop24.json"),
                assumptions=(f"link {rate} x {LINK_EFFICIENCY}, {HOP_LATENCY}/hop, a switch; "
                             f"{path[0]} by {path[1]}: {path[2]}"),
                predict=lambda o=op, p=ranks, r=rate, n=nbytes, i=implementation:
                    predicted_busbw(o, p, r, n, i) / 1e9,
            ))
    return tuple(out)
