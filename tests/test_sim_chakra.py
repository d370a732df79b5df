"""Chakra execution traces: our round trip, and a hand-made trace we did not write."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("google.protobuf")

from scaleout.scheduler.config import SchedulerConfig  # noqa: E402
from scaleout.sim.chakra import attributes, et_path, load_schema, read_et, write_et  # noqa: E402
from scaleout.sim.config import IterationConfig, codec_model  # noqa: E402
from scaleout.sim.graph import chakra_nodes, run_graph  # noqa: E402
from scaleout.sim.iteration import simulate  # noqa: E402
from scaleout.sim.models import DEVICES, model_workload  # noqa: E402
from scaleout.sim.network import parse_topology  # noqa: E402
from protobuf_wire import field, varint

MB = 1 << 20


def test_round_trip_reads_back_what_we_wrote_and_prices_it_like_the_simulator(tmp_path) -> None:
    work = model_workload("resnet50", device=DEVICES["p100"], batch_size=32)
    config = IterationConfig(scheduler=SchedulerConfig(policy="priority"), mode="sync")
    nodes = chakra_nodes(work, config)
    schema = load_schema()
    for rank in range(2):
        write_et(et_path(tmp_path / "rn50", rank), schema.GlobalMetadata(version="0.0.4"), nodes)
    metadata, back = read_et(tmp_path / "rn50.1.et")
    assert metadata.version == "0.0.4" and back == nodes
    coll = [n for n in back if schema.NodeType.Name(n.type) == "COMM_COLL_NODE"]
    assert {schema.CollectiveCommType.Name(attributes(n)["comm_type"]) for n in coll} == {
        "ALL_REDUCE"
    }
    assert sum(attributes(n)["comm_size"] for n in coll) == work.grad_bytes
    assert {attributes(n)["comm_priority"] for n in coll} == {0, 1}  # urgent lane = 1
    # executing the graph of a synchronous FIFO step gives the simulator's own iteration time
    fifo = IterationConfig(scheduler=SchedulerConfig(policy="fifo"), mode="sync")
    topo = parse_topology(
        "8x16", bandwidths=["20GB/s", "50Gbps"], latencies=["2us", "5us"], kinds=["ring", "switch"]
    )
    graph = run_graph(chakra_nodes(work, fifo), topo)
    assert graph.time == pytest.approx(simulate(work, topo, fifo).iteration_s, rel=1e-9)
    # the same with a gathered codec: comm_size is each rank's payload, the result npus times it
    sign = IterationConfig(scheduler=fifo.scheduler, mode="sync", codec=codec_model("sign"))
    graph = run_graph(chakra_nodes(work, sign), topo)
    assert graph.time == pytest.approx(simulate(work, topo, sign).iteration_s, rel=1e-6)


# A Chakra trace built by hand at the wire level (protobuf encoding, field numbers of et_def.proto),
# independent of scaleout's schema code (tests/protobuf_wire.py).
def _uint(number: int, value: int) -> bytes:
    return field(number, 0, varint(value))


def _bytes(number: int, value: bytes) -> bytes:
    return field(number, 2, varint(len(value)) + value)


def _attr_int64(name: str, value: int) -> bytes:  # AttributeProto{name=1, int64_val=9}
    return _bytes(1, name.encode()) + _uint(9, value)


def _node(
    node_id: int, name: str, node_type: int, duration_us: int = 0, data_deps=(), attrs=()
) -> bytes:
    body = _uint(1, node_id) + _bytes(2, name.encode()) + _uint(3, node_type)
    if data_deps:  # packed repeated uint64 (proto3 default)
        body += _bytes(5, b"".join(varint(d) for d in data_deps))
    if duration_us:
        body += _uint(7, duration_us)
    for attr in attrs:
        body += _bytes(10, attr)
    return body


def test_reads_and_runs_a_hand_made_foreign_trace(tmp_path) -> None:
    COMP, COLL, ALL_REDUCE, ALL_GATHER = 4, 7, 0, 2
    messages = [
        _bytes(1, b"0.0.4") + _bytes(2, _bytes(1, b"schema") + _bytes(29, b"hand-made")),
        _node(10, "fwd", COMP, 1000),
        _node(
            11,
            "grad_allreduce",
            COLL,
            data_deps=[10],
            attrs=[_attr_int64("comm_type", ALL_REDUCE), _attr_int64("comm_size", MB)],
        ),
        _node(12, "other_compute", COMP, 500, data_deps=[10]),
        _node(
            13,
            "gather",
            COLL,
            data_deps=[12],
            attrs=[
                _attr_int64("comm_type", ALL_GATHER),
                _attr_int64("comm_size", MB),
                _attr_int64("comm_priority", 5),
            ],
        ),
        _node(14, "step", COMP, 250, data_deps=[11, 13]),
    ]
    path = tmp_path / "foreign.0.et"
    path.write_bytes(b"".join(varint(len(m)) + m for m in messages))
    metadata, nodes = read_et(path)
    assert metadata.version == "0.0.4" and attributes(metadata) == {"schema": "hand-made"}
    assert [n.id for n in nodes] == [10, 11, 12, 13, 14] and list(nodes[1].data_deps) == [10]
    topo = parse_topology("2", bandwidths=[float(MB)], latencies=[0.0], kinds=["ring"])
    result = run_graph(nodes, topo)
    # fwd 0..1 ms; the 1 MB all-reduce (1 s at 1 MB/s on 2 ranks) from 1 ms while other_compute
    # runs 1..1.5 ms; the all-gather (each rank puts in 1 MB, receives the other's: 1 s) waits
    # for the network: 1.001..2.001; step after both: 2.001 + 0.00025
    assert result.time == pytest.approx(0.001 + 1.0 + 1.0 + 0.00025)
    assert result.compute_s == pytest.approx(0.00175)


def test_corrupt_and_cyclic_traces_are_reported(tmp_path) -> None:
    path = tmp_path / "bad.0.et"
    path.write_bytes(varint(50) + b"short")
    with pytest.raises(ValueError, match="runs past the end"):
        read_et(path)
    schema = load_schema()
    a = schema.Node(id=1, name="a", type=4, data_deps=[2], duration_micros=1)
    b = schema.Node(id=2, name="b", type=4, data_deps=[1], duration_micros=1)
    with pytest.raises(ValueError, match="cycle"):
        run_graph([a, b], parse_topology("2", bandwidths=[1.0]))
    with pytest.raises(ValueError, match="missing"):
        run_graph([schema.Node(id=1, data_deps=[7])], parse_topology("2", bandwidths=[1.0]))


# Malformed nodes: each is refused by the reader in one line that names the file, the node, the
# attribute and the value (the CLI prints it as a usage error, exit code 2).
def _bad_trace(tmp_path, nodes) -> str:
    schema = load_schema()
    path = tmp_path / "bad.0.et"
    write_et(path, schema.GlobalMetadata(version="0.0.4"), nodes)
    return str(path)


def _n(node_id: int, *, kind: str = "COMP_NODE", deps=(), **attrs):
    from scaleout.sim.chakra import make_attr

    schema = load_schema()
    node = schema.Node(id=node_id, name=f"n{node_id}", type=schema.NodeType.Value(kind),
                       data_deps=list(deps), duration_micros=1000)
    for key, value in attrs.items():
        node.attr.append(make_attr(key, value))
    return node


def _coll(node_id: int, **attrs):
    return _n(node_id, kind="COMM_COLL_NODE", deps=[0], **{"comm_type": 0, "comm_size": 100,
                                                            **attrs})


MALFORMED = {  # case -> (nodes, the message after the path)
    "nan duration": (lambda: [_n(0, duration_s=float("nan"))],
                     r"node 0 \('n0'\): duration_s must be a finite number of seconds >= 0, "
                     r"got nan"),
    "inf duration": (lambda: [_n(0, duration_s=float("inf"))],
                     r"node 0 \('n0'\): duration_s .* got inf"),
    "negative duration": (lambda: [_n(0, duration_s=-5.0)],
                          r"node 0 \('n0'\): duration_s .* got -5.0"),
    "string comm_size": (lambda: [_n(0), _coll(1, comm_size="big")],
                         r"node 1 \('n1'\): comm_size must be a finite number of bytes >= 0, "
                         r"got 'big'"),
    "negative comm_size": (lambda: [_n(0), _coll(1, comm_size=-10)],
                           r"node 1 \('n1'\): comm_size .* got -10$"),
    "string comm_type": (lambda: [_n(0), _coll(1, comm_type="ALL_REDUCE")],
                         r"node 1 \('n1'\): comm_type must be a CollectiveCommType "
                         r"\(0 ALL_REDUCE, .*9 BARRIER\), got 'ALL_REDUCE'"),
    "unknown comm_type": (lambda: [_n(0), _coll(1, comm_type=99)],
                          r"node 1 \('n1'\): comm_type must be a CollectiveCommType .*got 99$"),
    "float comm_priority": (lambda: [_n(0), _coll(1, comm_priority=1.5)],
                            r"node 1 \('n1'\): comm_priority must be an integer, got 1.5"),
    "nan codec_s": (lambda: [_n(0), _coll(1, codec_s=float("nan"))],
                    r"node 1 \('n1'\): codec_s must be a finite number of seconds >= 0, got nan"),
    "string send size": (lambda: [_n(0, kind="COMM_SEND_NODE", comm_size="big")],
                         r"node 0 \('n0'\): comm_size .* got 'big'"),
    "duplicate id": (lambda: [_n(3), _n(3)],
                     r"node id 3 appears twice \('n3' and 'n3'\): Chakra node ids must be unique"),
    "no nodes": (lambda: [], r"the Chakra trace has no nodes"),
    "missing dependency": (lambda: [_n(0), _n(1, deps=[7])],
                           r"node 1 \('n1'\) depends on missing nodes \[7\]"),
    "cycle": (lambda: [_n(0, deps=[1]), _n(1, deps=[0]), _n(2, deps=[1])],
              r"3 Chakra nodes can never run: the dependencies form a cycle: "
              r"(node 0 \('n0'\) -> node 1 \('n1'\) -> node 0|"
              r"node 1 \('n1'\) -> node 0 \('n0'\) -> node 1)$"),
    "self dependency": (lambda: [_n(0, deps=[0])],
                        r"1 Chakra nodes can never run: .* cycle: node 0 \('n0'\) -> node 0$"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_nodes_are_refused_by_the_reader_naming_file_node_and_value(tmp_path,
                                                                              case) -> None:
    make, message = MALFORMED[case]
    nodes = make()
    path = _bad_trace(tmp_path, nodes)
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {message}") as err:
        read_et(path)
    assert "\n" not in str(err.value)
    if nodes:  # the executor refuses them too (without a file to name)
        with pytest.raises(ValueError, match=f"^{message}"):
            run_graph(nodes, parse_topology("4", bandwidths=["100Gbps"]))


def test_the_cli_reports_a_malformed_node_as_a_usage_error(tmp_path, capsys) -> None:
    from scaleout.cli.main import main

    path = _bad_trace(tmp_path, [_n(0, duration_s=float("nan"))])
    argv = ["sim", "run", "--chakra", path, "--topology", "4", "--bandwidth", "100Gbps"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"scaleout sim: error: {path}: node 0 ('n0'): duration_s must be a finite "
                   "number of seconds >= 0, got nan")


def test_sound_edge_values_still_run(tmp_path) -> None:
    # zero durations and sizes, an integer duration_s, a negative priority, a BARRIER
    nodes = [_n(0, duration_s=0), _coll(1, comm_size=0, comm_priority=-1),
             _coll(2, comm_type=load_schema().CollectiveCommType.Value("BARRIER"))]
    _, back = read_et(_bad_trace(tmp_path, nodes))
    result = run_graph(back, parse_topology("4", bandwidths=["100Gbps"], latencies=["1us"]))
    assert result.nodes == 3 and result.compute_s == 0.0 and result.comm_s > 0
