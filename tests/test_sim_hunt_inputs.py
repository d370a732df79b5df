"""Inputs the simulator did not write: bandwidth units whose b/B decides bits or bytes, Chakra
nodes without a size, sends on a topology with a dimension of one NPU."""

from __future__ import annotations

import pytest

from scaleout.sim.network import preset
from scaleout.sim.units import parse_bandwidth, parse_bytes

GIB = 2**30


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [
        ("100Gbps", 100e9 / 8), ("100gbps", 100e9 / 8), ("25gbit", 25e9 / 8),
        ("1GBit", 1e9 / 8), ("100 bit/s", 12.5),
        ("100Gb/s", 100e9 / 8),  # bits: was read as 100 GiB/s (8.6x too fast)
        ("400GB/s", 400 * GIB), ("400GiB/s", 400 * GIB),
        ("100GBps", 100 * GIB),  # bytes: was read as 100 Gbit/s (8.6x too slow)
        ("1kB/s", 1024.0), ("1B/s", 1.0), ("1b/s", 0.125), ("1tbit", 1e12 / 8),
    ],
)
def test_the_b_of_a_rate_tells_bits_from_bytes(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["100 furlongs", "100", "Gbps", "100gb", "1e400Gbps", "0Gbps"])
def test_a_rate_that_is_not_one_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="bandwidth must") as err:
        parse_bandwidth(text)
    assert "\n" not in str(err.value) and repr(text) in str(err.value)


@pytest.mark.parametrize("text", ["0.4", "0.4B", 0.3])
def test_a_size_below_one_byte_is_refused(text) -> None:
    # it rounded to 0 B, and `sim collective --size 0.4` priced nothing, silently
    with pytest.raises(ValueError, match="at least one byte"):
        parse_bytes(text)
    assert parse_bytes("0") == 0 and parse_bytes("0.6") == 1


def test_the_cli_reads_gigabits_per_second(capsys) -> None:
    from scaleout.cli.main import main

    base = ["sim", "collective", "--topology", "8", "--latency", "5us", "--json"]
    assert main([*base, "--bandwidth", "100Gb/s"]) == 0
    bits = capsys.readouterr().out
    assert main([*base, "--bandwidth", "100Gbps"]) == 0
    assert capsys.readouterr().out == bits


def test_themis_on_one_npu_is_not_a_traceback(capsys) -> None:
    from scaleout.cli.main import main

    assert main(["sim", "collective", "--themis", "--topology", "1", "--json"]) == 0
    assert '"gain": 1.0' in capsys.readouterr().out


def _schema():
    pytest.importorskip("google.protobuf")
    from scaleout.sim.chakra import load_schema

    return load_schema()


def _node(node_id: int, kind: str, deps=(), **attrs):
    from test_sim_chakra import _n  # (after _schema(): it needs protobuf)

    return _n(node_id, kind=kind, deps=deps, **attrs)


@pytest.mark.parametrize(
    "kind, attrs",
    [("COMM_COLL_NODE", {"comm_type": 0}), ("COMM_COLL_NODE", {"comm_type": 6}),
     ("COMM_SEND_NODE", {}), ("COMM_RECV_NODE", {})],
)
def test_a_transfer_without_comm_size_is_refused_not_free(tmp_path, kind, attrs) -> None:
    # it was priced as 0 s, silently
    from scaleout.sim.chakra import read_et, write_et
    from scaleout.sim.graph import run_graph
    from scaleout.sim.network import parse_topology

    nodes = [_node(0, "COMP_NODE"), _node(1, kind, [0], **attrs)]
    message = rf"node 1 \('n1'\): a {kind} needs comm_size \(bytes on the wire\), and has none"
    with pytest.raises(ValueError, match=f"^{message}$"):
        run_graph(nodes, parse_topology("4", bandwidths=["1Gbps"]))
    path = tmp_path / "t.0.et"
    write_et(path, _schema().GlobalMetadata(version="0.0.4"), nodes)
    with pytest.raises(ValueError, match=f"^{path}: {message}$"):
        read_et(path)


def test_a_barrier_needs_no_size() -> None:
    from scaleout.sim.graph import run_graph
    from scaleout.sim.network import parse_topology

    barrier = _node(0, "COMM_COLL_NODE", comm_type=9)
    assert run_graph([barrier], parse_topology("4", bandwidths=[1.0], latencies=[1.0])).comm_s > 0


def test_a_send_crosses_a_dimension_that_has_links() -> None:
    # dgx-ethernet resized to 8 NPUs is 8x1: the send went on the 1-NPU Ethernet dimension
    # (2 x 5 us + 1 MiB at 100 Gbit/s = 93.9 us) instead of NVLink (2 x 1 us + 1 MiB at
    # 300 GB/s = 5.26 us)
    from scaleout.sim.graph import run_graph

    send = _node(0, "COMM_SEND_NODE", comm_size=1 << 20)
    topo = preset("dgx-ethernet").topology.with_npus(8)
    assert topo.shape == "8x1"
    assert run_graph([send], topo).comm_s == pytest.approx(2e-6 + 2**20 / (300 * GIB))
    assert run_graph([send], preset("dgx-ethernet").topology.with_npus(1)).comm_s == 0.0


def test_a_workload_with_a_layer_name_twice_is_refused() -> None:
    # its docstring said so; it was not checked, and the tuner's sizes by name merged them
    from scaleout.sim.workload import Layer, Workload

    layer = Layer(name="block", forward_s=1e-3, backward_s=2e-3, grad_bytes=4)
    with pytest.raises(ValueError, match="'block' more than once"):
        Workload(name="w", layers=(layer, layer))
