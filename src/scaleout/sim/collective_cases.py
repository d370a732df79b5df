"""Bus bandwidth of this machine's testbed collectives: measured by ``bench collectives``, predicted.

What is predicted: the bus bandwidth (nccl-tests convention, the bench's own) of every cell of
``scaleout bench collectives`` on the testbed (benchmarks/results/collectives-testbed-*.json,
commands in benchmarks/RESULTS.md §1): 2 and 3 ranks at 1 Gbit/s and 2 ranks at 100 Mbit/s,
allreduce, reduce_scatter, allgather, bcast and alltoall, 1 MB to 64 MB.

What goes in, and nothing else:

* the link: the ``tc`` rate x 0.98 and 50 us per hop through the bridge (a switch), as in
  :mod:`scaleout.sim.testbed_cases`. The 0.98 is the training split: the 2-rank 1 Gbit/s
  allreduce (RESULTS.md §1, stop 6: 0.122 GB/s), so those cells are not scored here;
* each op as the backend really runs it, read from its source (not from these numbers):
  :data:`GLOO`. Where gloo posts a ``send`` before the ``recv`` on a pair that carries data
  both ways (all-to-all; the all-gather ring at 2 ranks), the cell is priced by
  :mod:`scaleout.sim.gloo_pairs`, gloo's recv-ready protocol as a fluid model, which lets
  one direction of such a pair wait for the other; the rest by the alpha-beta formulas.
"""

from __future__ import annotations

from types import MappingProxyType

from scaleout.sim.collectives import bus_factor, collective_cost
from scaleout.sim.gloo_pairs import call_time
from scaleout.sim.network import parse_topology
from scaleout.sim.validation import Scenario

__all__ = ["GLOO", "MEASURED", "LINK_EFFICIENCY", "predicted_busbw", "collective_scenarios"]

LINK_EFFICIENCY = 0.98  # bus bandwidth / tc rate, the 2-rank 1 Gbit/s allreduce (training split)
HOP_LATENCY = "50us"
RELATIVE_BOUND = 0.15
RATES = MappingProxyType({"100mbit": 100e6 / 8, "1gbit": 1e9 / 8})

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

# (ranks, rate, op, bytes, measured median time in ms): the JSON files' time_s (ours).
MEASURED = (
    (2, "1gbit", "reduce_scatter", 1048576, 9.04),
    (2, "1gbit", "reduce_scatter", 4194304, 37.59),
    (2, "1gbit", "reduce_scatter", 16777216, 149.25),
    (2, "1gbit", "reduce_scatter", 67108864, 729.45),
    (2, "1gbit", "allgather", 1048576, 6.44),
    (2, "1gbit", "allgather", 4194304, 24.80),
    (2, "1gbit", "allgather", 16777216, 115.35),
    (2, "1gbit", "allgather", 67108864, 550.00),
    (2, "1gbit", "bcast", 1048576, 8.37),
    (2, "1gbit", "bcast", 4194304, 33.53),
    (2, "1gbit", "bcast", 16777216, 138.99),
    (2, "1gbit", "bcast", 67108864, 561.89),
    (2, "1gbit", "alltoall", 1048576, 6.80),
    (2, "1gbit", "alltoall", 4194304, 32.45),
    (2, "1gbit", "alltoall", 16777216, 136.49),
    (2, "1gbit", "alltoall", 67108864, 555.60),
    (3, "1gbit", "allreduce", 1048572, 11.89),
    (3, "1gbit", "allreduce", 4194300, 46.21),
    (3, "1gbit", "allreduce", 16777212, 182.28),
    (3, "1gbit", "allreduce", 67108860, 752.07),
    (3, "1gbit", "reduce_scatter", 1048572, 12.01),
    (3, "1gbit", "reduce_scatter", 4194300, 49.45),
    (3, "1gbit", "reduce_scatter", 16777212, 199.19),
    (3, "1gbit", "reduce_scatter", 67108860, 894.54),
    (3, "1gbit", "allgather", 1048572, 6.13),
    (3, "1gbit", "allgather", 4194300, 24.72),
    (3, "1gbit", "allgather", 16777212, 98.35),
    (3, "1gbit", "allgather", 67108860, 560.25),
    (3, "1gbit", "bcast", 1048572, 16.82),
    (3, "1gbit", "bcast", 4194300, 67.00),
    (3, "1gbit", "bcast", 16777212, 270.35),
    (3, "1gbit", "bcast", 67108860, 1089.22),
    (3, "1gbit", "alltoall", 1048572, 6.96),
    (3, "1gbit", "alltoall", 4194300, 35.12),
    (3, "1gbit", "alltoall", 16777212, 147.13),
    (3, "1gbit", "alltoall", 67108860, 526.29),
    (2, "100mbit", "allreduce", 1048576, 87.83),
    (2, "100mbit", "allreduce", 4194304, 339.29),
    (2, "100mbit", "allreduce", 16777216, 1445.02),
    (2, "100mbit", "reduce_scatter", 1048576, 87.04),
    (2, "100mbit", "reduce_scatter", 4194304, 344.89),
    (2, "100mbit", "reduce_scatter", 16777216, 1381.68),
    (2, "100mbit", "allgather", 1048576, 59.22),
    (2, "100mbit", "allgather", 4194304, 251.58),
    (2, "100mbit", "allgather", 16777216, 1065.94),
    (2, "100mbit", "bcast", 1048576, 83.86),
    (2, "100mbit", "bcast", 4194304, 336.42),
    (2, "100mbit", "bcast", 16777216, 1357.69),
    (2, "100mbit", "alltoall", 1048576, 86.31),
    (2, "100mbit", "alltoall", 4194304, 328.47),
    (2, "100mbit", "alltoall", 16777216, 1369.12),
)


def _bus(op: str, ranks: int) -> float:
    """busbw / algbw of a bench op, by its own name (a reduce_scatter's factor, whatever gloo
    moves for it): what ``bench collectives`` reports."""
    return bus_factor(_SIM_NAME.get(op, op), ranks)


def predicted_busbw(op: str, ranks: int, rate: str, nbytes: int) -> float:
    """The bus bandwidth (bytes/s) the simulator predicts for one bench cell.

    Raises:
        ValueError: an op not in :data:`GLOO` or a rate not in ``RATES``.
    """
    if op not in GLOO:
        raise ValueError(f"op must be one of {', '.join(GLOO)}, got {op!r}")
    if rate not in RATES:
        raise ValueError(f"rate must be one of {', '.join(RATES)}, got {rate!r}")
    sim_op, algorithm, _ = GLOO[op]
    topology = parse_topology(str(ranks), bandwidths=[RATES[rate] * LINK_EFFICIENCY],
                              latencies=[HOP_LATENCY], kinds=["switch"])
    if algorithm == "gloo_pairs":
        dim = topology.dims[0]
        time = call_time(sim_op, ranks, nbytes, bandwidth=dim.bandwidth,
                         latency=dim.hops() * dim.latency)
    else:
        time = collective_cost(topology, op=sim_op, algorithm=algorithm, nbytes=nbytes).time
    return nbytes / time * _bus(op, ranks)


def collective_scenarios() -> tuple[Scenario, ...]:
    """One scenario per measured cell: bus bandwidth in GB/s, within 15%."""
    out = []
    for ranks, rate, op, nbytes, ms in MEASURED:
        measured = nbytes / (ms / 1e3) * _bus(op, ranks) / 1e9
        out.append(Scenario(
            name=f"{op} {nbytes / 2**20:.0f}MB {ranks} ranks {rate}",
            group="collectives",
            measured=measured,
            unit="GB/s",
            bound=RELATIVE_BOUND,
            source=f"bench collectives, benchmarks/results/collectives-testbed-{ranks}r-{rate}.json",
            assumptions=(f"link {rate} x {LINK_EFFICIENCY}, {HOP_LATENCY}/hop, a switch; "
                         f"{GLOO[op][0]} by {GLOO[op][1]}: {GLOO[op][2]}"),
            predict=lambda o=op, p=ranks, r=rate, n=nbytes: predicted_busbw(o, p, r, n) / 1e9,
        ))
    return tuple(out)
