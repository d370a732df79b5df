"""Collective formulas worked by hand (a = 1 s per hop, B = 1 B/s), and what an iteration
counts as compute: defects found by hunting, each checked against the hand-worked figure."""

from __future__ import annotations

import pytest

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.collectives import collective_cost
from scaleout.sim.config import IterationConfig
from scaleout.sim.iteration import simulate
from scaleout.sim.network import parse_topology
from scaleout.sim.themis import pipelined_allreduce, themis_gain
from scaleout.sim.workload import Layer, Workload


def _time(p: int, kind: str, op: str, algorithm: str, nbytes: float) -> float:
    topo = parse_topology(str(p), bandwidths=[1.0], latencies=[1.0], kinds=[kind])
    return collective_cost(topo, op=op, algorithm=algorithm, nbytes=nbytes).time


@pytest.mark.parametrize(
    "p, kind, op, algorithm, nbytes, by_hand",
    [
        # direct broadcast: the root's p-1 copies leave on p-1 links at once on a fully
        # connected dimension (a + n/B; was (p-1) n/B, as through one NIC: 25)
        (4, "fully_connected", "broadcast", "direct", 8, 1 + 8),
        # ... and on a ring the farthest peer is p/2 hops away (was 1 hop: 57)
        (8, "ring", "broadcast", "direct", 8, 4 + 7 * 8),
        # a switch: 2 hops, one NIC (unchanged)
        (8, "switch", "broadcast", "direct", 8, 2 + 7 * 8),
        # binomial broadcast on a ring: step k reaches 2^k away, h = 1 + 2 + 4 (was 3 hops: 6)
        (8, "ring", "broadcast", "halving_doubling", 1, 7 + 3 * 1),
        # p = 6: ceil(lg 6) = 3 steps at distances 1, 2, 4 -> hops 1, 2, 2 (was 6)
        (6, "ring", "broadcast", "halving_doubling", 1, 5 + 3 * 1),
        # Bruck all-to-all on a ring: 3 steps of n/2 at distances 1, 2, 4 (was 15)
        (8, "ring", "alltoall", "halving_doubling", 8, 7 + 3 * 4),
        # a switch: 2 hops a step whatever the distance (unchanged)
        (8, "switch", "alltoall", "halving_doubling", 8, 3 * 2 + 3 * 4),
    ],
)
def test_per_dimension_costs_use_the_hop_model(p, kind, op, algorithm, nbytes, by_hand) -> None:
    assert _time(p, kind, op, algorithm, nbytes) == pytest.approx(by_hand)


def test_a_tree_asked_for_an_op_it_does_not_price_is_labelled_as_the_ring_it_ran() -> None:
    topo = parse_topology("8", bandwidths=[1.0], latencies=[1.0])
    for op in ("reduce_scatter", "allgather", "alltoall"):
        tree = collective_cost(topo, op=op, algorithm="double_binary_tree", nbytes=64)
        ring = collective_cost(topo, op=op, algorithm="ring", nbytes=64)
        assert (tree.algorithm, tree.time) == ("ring", ring.time), op
    for op in ("allreduce", "broadcast"):
        assert collective_cost(topo, op=op, algorithm="double_binary_tree",
                               nbytes=64).algorithm == "double_binary_tree"


def test_themis_on_one_npu_costs_nothing() -> None:
    # every dimension of size 1: Themis ordered no dimension and raised IndexError (a traceback
    # from `sim collective --themis --topology 1`); nothing crosses a link, as for collectives
    topo = parse_topology("1x1", bandwidths=["1Gbps"])
    assert pipelined_allreduce(topo, nbytes=1 << 20, scheduler="themis").time == 0.0
    gain, base, them = themis_gain(topo, nbytes=1 << 20)
    assert (gain, base.time, them.time) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_an_update_without_gradients_is_not_compute(mode: str) -> None:
    # a layer with no gradients never runs its update: compute counted it (3.5 s against a
    # 3.0 s iteration: efficiency 117%)
    w = Workload(name="w", layers=(
        Layer(name="embed", forward_s=1.0, backward_s=2.0, grad_bytes=0, update_s=0.5),))
    r = simulate(w, parse_topology("2", bandwidths=[1e9]),
                 IterationConfig(mode=mode, scheduler=SchedulerConfig(policy="fifo")))
    assert (r.iteration_s, r.compute_s, r.efficiency) == (3.0, 3.0, 1.0)
    assert w.compute_s == 3.0


def test_iteration_never_below_compute_on_random_workloads() -> None:
    import random

    rng = random.Random(7)
    for _ in range(40):
        layers = tuple(
            Layer(name=f"l{i}", forward_s=rng.choice([0.0, 1e-3]),
                  backward_s=rng.choice([0.0, 2e-3]), grad_bytes=rng.choice([0, 1000, 1 << 20]),
                  update_s=rng.choice([0.0, 1e-4]))
            for i in range(rng.randint(1, 5)))
        w = Workload(name="w", layers=layers)
        for mode in ("sync", "overlap"):
            r = simulate(w, parse_topology("4", bandwidths=["1Gbps"], latencies=["5us"]),
                         IterationConfig(mode=mode))
            assert r.iteration_s >= r.compute_s * (1 - 1e-12) and r.efficiency <= 1 + 1e-12
