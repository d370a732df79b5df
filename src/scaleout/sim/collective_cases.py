"""Bus bandwidth of this machine's testbed collectives: measured by ``bench collectives``, predicted.

What is predicted: the bus bandwidth (nccl-tests convention, the bench's own) of every cell of
``scaleout bench collectives`` on the testbed (benchmarks/results/stop38/collectives/, the
commands in its run.sh; stop 24's, in benchmarks/RESULTS.md §1, until stop 38): 2 and 3 ranks
at 1 Gbit/s and 2 ranks at 100 Mbit/s,
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
# and torch_time_s, the training split (2 ranks, 1 Gbit/s, allreduce) left out. Since stop 38
# the cells of benchmarks/results/stop38/collectives/ (5 rounds, the code of 1e17b68), which
# the model was not built on; before, stop 24's (3 rounds: collectives-testbed-*-stop24.json,
# 93 of 102 within 15%, against 99 of 102 here: benchmarks/RESULTS.md, stop 38).
MEASURED = (
    (2, "1gbit", "reduce_scatter", 1048576, 4.31, 8.46),
    (2, "1gbit", "reduce_scatter", 4194304, 19.22, 36.13),
    (2, "1gbit", "reduce_scatter", 16777216, 74.14, 141.96),
    (2, "1gbit", "reduce_scatter", 67108864, 278.69, 565.18),
    (2, "1gbit", "allgather", 1048576, 4.58, 5.17),
    (2, "1gbit", "allgather", 4194304, 18.21, 25.28),
    (2, "1gbit", "allgather", 16777216, 75.20, 105.05),
    (2, "1gbit", "allgather", 67108864, 282.10, 437.09),
    (2, "1gbit", "bcast", 1048576, 8.34, 8.33),
    (2, "1gbit", "bcast", 4194304, 33.56, 33.47),
    (2, "1gbit", "bcast", 16777216, 135.02, 134.98),
    (2, "1gbit", "bcast", 67108864, 540.70, 540.57),
    (2, "1gbit", "alltoall", 1048576, 4.80, 6.37),
    (2, "1gbit", "alltoall", 4194304, 18.46, 32.55),
    (2, "1gbit", "alltoall", 16777216, 74.03, 135.22),
    (2, "1gbit", "alltoall", 67108864, 277.31, 545.00),
    (3, "1gbit", "allreduce", 1048572, 11.91, 11.40),
    (3, "1gbit", "allreduce", 4194300, 45.66, 45.06),
    (3, "1gbit", "allreduce", 16777212, 181.57, 182.19),
    (3, "1gbit", "allreduce", 67108860, 723.61, 735.02),
    (3, "1gbit", "reduce_scatter", 1048572, 6.89, 11.35),
    (3, "1gbit", "reduce_scatter", 4194300, 26.39, 48.28),
    (3, "1gbit", "reduce_scatter", 16777212, 102.47, 187.12),
    (3, "1gbit", "reduce_scatter", 67108860, 380.05, 757.33),
    (3, "1gbit", "allgather", 1048572, 5.82, 5.71),
    (3, "1gbit", "allgather", 4194300, 25.64, 24.42),
    (3, "1gbit", "allgather", 16777212, 100.51, 98.04),
    (3, "1gbit", "allgather", 67108860, 404.71, 404.18),
    (3, "1gbit", "bcast", 1048572, 16.76, 16.68),
    (3, "1gbit", "bcast", 4194300, 67.38, 67.36),
    (3, "1gbit", "bcast", 16777212, 270.16, 270.08),
    (3, "1gbit", "bcast", 67108860, 1081.47, 1081.38),
    (3, "1gbit", "alltoall", 1048572, 6.64, 7.76),
    (3, "1gbit", "alltoall", 4194300, 25.70, 35.31),
    (3, "1gbit", "alltoall", 16777212, 105.16, 146.45),
    (3, "1gbit", "alltoall", 67108860, 369.46, 522.52),
    (2, "100mbit", "allreduce", 1048576, 84.18, 84.32),
    (2, "100mbit", "allreduce", 4194304, 343.18, 339.90),
    (2, "100mbit", "allreduce", 16777216, 1396.93, 1365.99),
    (2, "100mbit", "reduce_scatter", 1048576, 43.25, 84.22),
    (2, "100mbit", "reduce_scatter", 4194304, 178.20, 347.83),
    (2, "100mbit", "reduce_scatter", 16777216, 739.64, 1368.32),
    (2, "100mbit", "allgather", 1048576, 43.62, 59.80),
    (2, "100mbit", "allgather", 4194304, 180.99, 255.29),
    (2, "100mbit", "allgather", 16777216, 712.58, 1076.30),
    (2, "100mbit", "bcast", 1048576, 83.84, 83.94),
    (2, "100mbit", "bcast", 4194304, 337.42, 337.40),
    (2, "100mbit", "bcast", 16777216, 1351.50, 1351.51),
    (2, "100mbit", "alltoall", 1048576, 41.87, 74.80),
    (2, "100mbit", "alltoall", 4194304, 169.46, 330.15),
    (2, "100mbit", "alltoall", 16777216, 703.89, 1344.64),
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
                source=(f"bench collectives ({implementation}), benchmarks/results/stop38/"
                        f"collectives/collectives-testbed-{ranks}r-{rate}.json"),
                assumptions=(f"link {rate} x {LINK_EFFICIENCY}, {HOP_LATENCY}/hop, a switch; "
                             f"{path[0]} by {path[1]}: {path[2]}"),
                predict=lambda o=op, p=ranks, r=rate, n=nbytes, i=implementation:
                    predicted_busbw(o, p, r, n, i) / 1e9,
            ))
    return tuple(out)
