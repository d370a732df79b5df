"""Simulator building blocks: event core, units, topologies, collectives (golden), Themis."""

from __future__ import annotations

import pytest

from scaleout.sim.collectives import collective_cost, phase_time
from scaleout.sim.events import EventQueue
from scaleout.sim.network import Dimension, parse_topology, preset
from scaleout.sim.themis import pipelined_allreduce, themis_gain
from scaleout.sim.units import parse_bandwidth, parse_bytes, parse_time


def test_event_queue_orders_by_time_then_priority_then_insertion() -> None:
    q, seen = EventQueue(), []
    q.schedule(1.0, lambda: seen.append("late-prio"), priority=1)
    q.schedule(1.0, lambda: seen.append("a"))
    q.schedule(1.0, lambda: seen.append("b"))
    q.schedule(0.5, lambda: q.after(0.5, lambda: seen.append("nested")))
    assert q.run() == 1.0
    assert seen == ["a", "b", "nested", "late-prio"]
    with pytest.raises(ValueError, match="earlier than now"):
        q.schedule(0.1, lambda: None)


def test_units() -> None:
    assert parse_bytes("64MB") == 64 << 20 and parse_bytes("1.5K") == 1536
    assert parse_bandwidth("100Gbps") == 100e9 / 8
    assert parse_bandwidth("400GB/s") == 400 * 2**30
    assert parse_time("936.25ns") == pytest.approx(936.25e-9)
    with pytest.raises(ValueError, match="100Gbps"):
        parse_bandwidth("100 furlongs")
    with pytest.raises(TypeError):
        parse_bytes(None)  # type: ignore[arg-type]


def test_topology_parsing_coordinates_and_hops() -> None:
    topo = parse_topology(
        "4x3", bandwidths=["1GB/s", "100Mbps"], latencies="1us", kinds=["ring", "switch"]
    )
    assert topo.npus == 12 and topo.coords(5) == (1, 1)
    # 0 -> 2 differ on dim 0 (a ring of 4, 2 hops either way); 0 -> 4 on dim 1 (switch, 2 hops)
    assert topo.message_time(0, 2, 0) == pytest.approx(2e-6)
    assert topo.message_time(0, 4, 1e6 / 8) == pytest.approx(2e-6 + 0.01)
    assert topo.with_npus(24).shape == "4x6"
    assert preset("hgx-h100").topology.dims[0].latency == pytest.approx(936.25e-9)
    with pytest.raises(ValueError, match="8x128"):
        parse_topology("8by128", bandwidths="1Gbps")
    with pytest.raises(ValueError, match="one per dimension"):
        parse_topology("2x2", bandwidths=["1Gbps"] * 3)
    with pytest.raises(ValueError, match="kind"):
        Dimension(kind="torus", npus=2, bandwidth=1.0, latency=0.0)


def test_a_link_is_at_least_one_bit_per_second() -> None:
    # 1e-300bps priced collectives as inf (JSON Infinity); 1 bit/s still prices finitely
    assert Dimension(kind="ring", npus=2, bandwidth=1 / 8, latency=0.0).bandwidth == 0.125
    for text in ("1e-300bps", "0.5bps"):
        with pytest.raises(ValueError, match=r"at least 1 bit/s \(0.125 bytes/s\)"):
            parse_topology("8", bandwidths=text)


def _one(p: int, kind: str, a: float = 0.0, bw: float = 1.0):
    return parse_topology(str(p), bandwidths=[bw], latencies=[a], kinds=[kind])


def test_empty_and_one_npu_collectives_cost_nothing_and_report_no_bandwidth() -> None:
    # 0 bytes: skipped, 0 s; 1 byte pays every step's latency; one NPU: nothing crosses a link.
    # A collective that takes no time reports algbw and busbw 0 (not inf, which JSON lacks).
    empty = collective_cost(_one(4, "ring", 0.5), op="allreduce", algorithm="ring", nbytes=0)
    assert (empty.time, empty.algbw, empty.busbw) == (0.0, 0.0, 0.0)
    one_byte = collective_cost(_one(4, "ring", 0.5), op="allreduce", algorithm="ring", nbytes=1)
    assert one_byte.time == pytest.approx(6 * (0.5 + 1 / 4)) and one_byte.algbw > 0
    for op in ("allreduce", "allgather", "broadcast", "alltoall"):
        alone = collective_cost(_one(1, "ring", 0.5), op=op, algorithm="ring", nbytes=1 << 20)
        assert (alone.time, alone.algbw, alone.busbw) == (0.0, 0.0, 0.0), op
    for bad in (-1, float("nan"), float("inf"), True, "8"):
        with pytest.raises(ValueError, match="nbytes must be a finite number >= 0"):
            collective_cost(_one(4, "ring"), op="allreduce", algorithm="ring", nbytes=bad)


def test_ring_allreduce_golden() -> None:
    # 2(p-1) steps of n/p, one hop each: 6 x (0.5 + 8/4) = 15
    cost = collective_cost(_one(4, "ring", 0.5), op="allreduce", algorithm="ring", nbytes=8)
    assert cost.time == pytest.approx(15.0)
    assert cost.busbw == pytest.approx(cost.algbw * 2 * 3 / 4)
    assert cost.utilisation()[0] == pytest.approx(12.0 / 15.0)


def test_halving_doubling_golden() -> None:
    # p=8 on a switch (2 hops): per half 3 x 2 x 1 + (4 + 2 + 1) = 13; all-reduce 26
    # = 2 lg p (2a) + 2 (p-1)/p n / B of Thakur, Rabenseifner & Gropp
    cost = collective_cost(
        _one(8, "switch", 1.0), op="allreduce", algorithm="halving_doubling", nbytes=8
    )
    assert cost.time == pytest.approx(26.0)
    # p=3: fold one rank in (a full 6-byte exchange), halve over 2, per half: 6 + 3 = 9
    assert phase_time(
        Dimension(kind="fully_connected", npus=3, bandwidth=1.0, latency=0.0),
        "reduce_scatter",
        "halving_doubling",
        6,
    )[0] == pytest.approx(9.0)


def test_double_binary_tree_and_direct_golden() -> None:
    tree = collective_cost(
        _one(8, "ring", 1.0), op="allreduce", algorithm="double_binary_tree", nbytes=8
    )
    # level k of the tree joins NPUs 2^k apart: h(1) + h(2) + h(4) = 7 hops up, 7 down (since
    # stop 52; it was 3 + 3, one hop a level: tests/test_sim_backlog.py)
    assert tree.time == pytest.approx(2 * 7 * 1.0 + 2 * 8)
    # direct on a fully connected group: one round of n/p per peer, in parallel, twice
    direct = collective_cost(
        _one(4, "fully_connected", 1.0), op="allreduce", algorithm="direct", nbytes=8
    )
    assert direct.time == pytest.approx(2 * (1.0 + 2.0))
    with pytest.raises(ValueError, match="double_binary_tree"):
        phase_time(
            Dimension(kind="ring", npus=4, bandwidth=1.0, latency=0.0),
            "alltoall",
            "double_binary_tree",
            8,
        )


def test_hierarchical_allreduce_timeline_golden() -> None:
    topo = parse_topology(
        "2x4", bandwidths=[2.0, 1.0], latencies=[0.0, 0.0], kinds=["ring", "ring"]
    )
    cost = collective_cost(topo, op="allreduce", algorithm="ring", nbytes=16)
    # RS on dim 0: 1 step of 8 bytes at 2 B/s = 4; all-reduce of 8 on dim 1: 6 x 2 = 12; AG 4
    assert [(p.dim, p.op, p.start, p.end) for p in cost.phases] == [
        (0, "reduce_scatter", 0.0, 4.0),
        (1, "allreduce", 4.0, 16.0),
        (0, "allgather", 16.0, 20.0),
    ]
    flat = collective_cost(topo, op="allreduce", algorithm="ring", nbytes=16, flat=True)
    assert flat.time == pytest.approx(2 * 7 * 16 / 8 / 1.0)  # one ring of 8 at the slow speed


def test_themis_balances_dimensions() -> None:
    topo = parse_topology("16x16", bandwidths=[1.0, 1.0], kinds="ring")
    gain, base, them = themis_gain(topo, nbytes=2**20, chunks=32)
    assert gain > 1.5
    assert min(them.utilisation()) > 0.9 > max(base.utilisation()[1:])
    assert len({o for o in them.orders}) == 2  # chunks alternate which dimension goes first
    one = pipelined_allreduce(_one(4, "ring"), nbytes=8, chunks=1)
    assert one.time == pytest.approx(12.0)  # a single dimension: just the ring all-reduce
    with pytest.raises(ValueError, match="scheduler"):
        pipelined_allreduce(topo, nbytes=1, scheduler="random")


@pytest.mark.parametrize("algorithm", ["ring", "direct", "halving_doubling", "double_binary_tree"])
def test_collectives_monotone_in_bandwidth_latency_and_size(algorithm: str) -> None:
    def t(bw: float, lat: float, n: float) -> float:
        topo = parse_topology(
            "8x16", bandwidths=[bw * 4, bw], latencies=[lat, lat], kinds=["ring", "switch"]
        )
        return collective_cost(topo, op="allreduce", algorithm=algorithm, nbytes=n).time

    for n in (1e3, 1e6, 1e9):
        assert t(2e9, 1e-6, n) <= t(1e9, 1e-6, n)
        assert t(1e9, 2e-6, n) >= t(1e9, 1e-6, n)
        assert t(1e9, 1e-6, 2 * n) >= t(1e9, 1e-6, n)


def test_docstring_examples_run() -> None:
    import doctest
    import importlib

    for name in (
        "units",
        "events",
        "network",
        "collectives",
        "themis",
        "workload",
        "models",
        "iteration",
        "trace",
        "chrome",
        "scaling",
    ):
        module = importlib.import_module(f"scaleout.sim.{name}")
        failed, attempted = doctest.testmod(module)
        assert failed == 0 and attempted > 0, name


def test_themis_smallest_chunk_first_keeps_dimensions_fed() -> None:
    topo = parse_topology(
        "4x8x8", bandwidths=["200GB/s", "100GB/s", "50GB/s"], latencies="500ns",
        kinds=["ring", "fully_connected", "switch"],
    )
    runs = {
        intra: pipelined_allreduce(topo, nbytes=2**30, chunks=16, scheduler="themis", intra=intra)
        for intra in ("fifo", "scf")
    }
    # FIFO: every chunk's full-size first phase queues ahead of the small later ones
    assert runs["scf"].time < 0.9 * runs["fifo"].time
    default = pipelined_allreduce(topo, nbytes=2**30, chunks=16, scheduler="themis")
    assert default.time == runs["scf"].time  # Themis comes with SCF, the baseline with FIFO
    base = pipelined_allreduce(topo, nbytes=2**30, chunks=16)
    assert base.time == pipelined_allreduce(topo, nbytes=2**30, chunks=16, intra="fifo").time
    with pytest.raises(ValueError, match="intra"):
        pipelined_allreduce(topo, nbytes=1, intra="lifo")
