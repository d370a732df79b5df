"""Left-alone simulator defects (stop 52), each checked against a figure worked by hand:
sizes in bits, Chakra's newer node types, a REDUCE's price, the tree's hops on a ring."""

from __future__ import annotations

import json

import pytest

from scaleout.sim.collectives import collective_cost
from scaleout.sim.network import parse_topology
from scaleout.sim.units import parse_bytes
from protobuf_wire import field, varint


def _topo(p: int, kind: str = "ring", a: float = 1.0, bw: float = 1.0):
    return parse_topology(str(p), bandwidths=[bw], latencies=[a], kinds=[kind])


# --- sizes: a lower-case b is bits, as in a rate ---------------------------------------------

@pytest.mark.parametrize("text", ["64Mb", "64mb", "64kb", "1.5Gb", "8b", "64Mib"])
def test_a_size_in_bits_is_refused_not_read_as_bytes(text: str) -> None:
    # `--size 64Mb` (64 megabits, 8e6 B) priced 64 MiB, 8.4x the bytes, silently
    with pytest.raises(ValueError, match="lower-case b .* bits") as err:
        parse_bytes(text)
    assert repr(text) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, nbytes", [("64MB", 64 << 20), ("64MiB", 64 << 20),
                                          ("64mB", 64 << 20), ("64M", 64 << 20), ("8B", 8),
                                          ("1KB", 1024), ("2GiB", 2 << 30), ("4096", 4096)])
def test_sizes_in_bytes_are_binary_whatever_the_prefix_case(text: str, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes  # MB and MiB alike, as docs/simulator.md says


def test_the_cli_refuses_a_size_in_bits_with_exit_code_2(capsys) -> None:
    from scaleout.cli.main import main

    assert main(["sim", "collective", "--size", "64Mb"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaleout sim: error: size '64Mb'") and "64MB" in err


# --- the double binary tree on a ring --------------------------------------------------------

@pytest.mark.parametrize("p, op, by_hand", [
    # ring of 8, a = 1 s, B = 1 B/s, n = 8 B: ASTRA-sim's in-order tree has its levels 1, 2
    # and 4 NPUs apart, h = 1 + 2 + 4 = 7 each way; 2 x 7 + 2 x 8 (it was 2 x 3 + 16 = 22)
    (8, "allreduce", 2 * 7 + 2 * 8),
    (8, "broadcast", 7 + 8),  # (was 3 + 8)
    # ring of 6: levels 1, 2, 4 apart -> hops 1, 2, 2 (the shorter way) = 5 (was 3)
    (6, "allreduce", 2 * 5 + 2 * 8),
])
def test_a_tree_on_a_ring_pays_the_hops_between_its_levels(p: int, op: str,
                                                           by_hand: float) -> None:
    cost = collective_cost(_topo(p), op=op, algorithm="double_binary_tree", nbytes=8)
    assert cost.time == pytest.approx(by_hand)


def test_a_tree_on_a_switch_is_unchanged() -> None:
    # 2 hops a level whatever the distance: 2 x (3 x 2) + 2 x 8
    cost = collective_cost(_topo(8, "switch"), op="allreduce", algorithm="double_binary_tree",
                           nbytes=8)
    assert cost.time == pytest.approx(2 * 3 * 2 + 2 * 8)


# --- Chakra: a REDUCE, and node types 8-10 ---------------------------------------------------

def _node(node_id: int, kind: str, deps=(), duration_us: int = 0, **attrs):
    from scaleout.sim.chakra import load_schema, make_attr

    schema = load_schema()
    node = schema.Node(id=node_id, name=f"n{node_id}", type=schema.NodeType.Value(kind),
                       data_deps=list(deps), duration_micros=duration_us)
    for key, value in attrs.items():
        node.attr.append(make_attr(key, value))
    return node


def test_a_chakra_reduce_pays_at_least_the_whole_vector_into_the_root() -> None:
    pytest.importorskip("google.protobuf")
    from scaleout.sim.chakra import COMM_TYPES
    from scaleout.sim.graph import run_graph

    # ring of 4, a = 0, B = 1 B/s, 4 B: the root ends with 4 reduced bytes, at least n/B = 4 s;
    # priced as a broadcast backwards (reduce-scatter + gather): 2 x 3 x 1 B = 6 s. As a
    # reduce-scatter it was 3 s, under the lower bound.
    reduce = _node(0, "COMM_COLL_NODE", comm_type=COMM_TYPES.index("REDUCE"), comm_size=4)
    assert run_graph([reduce], _topo(4, a=0.0)).time == pytest.approx(6.0)
    # SCATTER and GATHER move (p-1)/p of the vector through the root's link: 3 s (unchanged)
    for name in ("SCATTER", "GATHER"):
        size = 4 if name == "SCATTER" else 1  # GATHER's comm_size is each rank's piece
        node = _node(0, "COMM_COLL_NODE", comm_type=COMM_TYPES.index(name), comm_size=size)
        assert run_graph([node], _topo(4, a=0.0)).time == pytest.approx(3.0), name




def _wire_node(node_id: int, node_type: int, duration_us: int, deps=(), storage=b"") -> bytes:
    body = field(1, 0, varint(node_id)) + field(3, 0, varint(node_type))
    if deps:
        packed = b"".join(varint(d) for d in deps)
        body += field(5, 2, varint(len(packed)) + packed)
    if duration_us:
        body += field(7, 0, varint(duration_us))
    if storage:  # Node.storage = 11, a StorageInfo our schema does not know
        body += field(11, 2, varint(len(storage)) + storage)
    return body


def test_storage_batch_and_checkpoint_nodes_load_and_run_for_their_duration(tmp_path) -> None:
    pytest.importorskip("google.protobuf")
    from scaleout.sim.chakra import read_et
    from scaleout.sim.graph import run_graph

    COMP, STORAGE, BATCH, CHECKPOINT = 4, 8, 9, 10
    storage_info = field(1, 0, varint(1))  # StorageInfo{level = STORAGE_LEVEL_FS}
    messages = [
        field(1, 2, varint(5) + b"0.0.4"),  # GlobalMetadata{version}
        _wire_node(1, BATCH, 300),
        _wire_node(2, STORAGE, 200, deps=[1], storage=storage_info),
        _wire_node(3, COMP, 1000, deps=[2]),
        _wire_node(4, CHECKPOINT, 0, deps=[3]),  # no duration recorded: 0 s
    ]
    path = tmp_path / "io.0.et"
    path.write_bytes(b"".join(varint(len(m)) + m for m in messages))
    _, nodes = read_et(path)  # it was refused: "type must be a NodeType (...), got 9"
    result = run_graph(nodes, _topo(8, bw=1e9))
    # a chain on the compute stream: 300 + 200 + 1000 + 0 us, no network
    assert result.time == pytest.approx(1.5e-3) and result.compute_s == pytest.approx(1.5e-3)
    assert result.comm_s == 0.0 and result.nodes == 4


def test_the_cli_runs_a_trace_with_a_checkpoint_node(tmp_path, capsys) -> None:
    pytest.importorskip("google.protobuf")
    from scaleout.cli.main import main
    from scaleout.sim.chakra import load_schema, write_et

    nodes = [_node(0, "COMP_NODE", duration_us=100),
             _node(1, "CHECKPOINT_NODE", deps=[0], duration_us=400)]
    path = tmp_path / "ckpt.0.et"
    write_et(path, load_schema().GlobalMetadata(version="0.0.4"), nodes)
    argv = ["sim", "run", "--chakra", str(path), "--topology", "4", "--bandwidth", "100Gbps",
            "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nodes"] == 2 and data["iteration_s"] == pytest.approx(500e-6)
