"""Chakra node graphs: built from a workload and the runtime's plan, and executed.

:func:`chakra_nodes` writes one iteration of data-parallel training as Chakra nodes: a
chain of forward COMP nodes, a chain of backward COMP nodes, one COMM_COLL node per bucket of
:func:`scaleout.scheduler.plan_and_policy` (``comm_type`` ALL_REDUCE, or ALL_GATHER for a codec
whose payloads do not add; ``comm_size`` its bytes on the wire; ``comm_priority`` higher for
more urgent lanes) with a data dependency on the backward node that completes the bucket and
a control dependency on the previous bucket (the issue order), then an ``update`` COMP node
after every bucket (the DDP-like synchronous step). Durations are ``duration_micros``, plus a
``duration_s`` double attribute that keeps sub-microsecond precision for our own reader.

:func:`run_graph` executes any rank's node list, including traces written by other tools:
a node runs once its data and control dependencies have finished; COMP (and MEM_*) nodes run
one at a time on the compute stream, lowest id first (so do STORAGE, BATCH and CHECKPOINT
nodes, since stop 52: for their recorded ``duration_s`` or ``duration_micros``, 0 without, what
the trace measured them to take); collective nodes one at a time on the network, highest
``comm_priority`` first, priced by
:func:`~scaleout.sim.collectives.collective_cost` on the given topology (so a trace recorded
on 2 ranks is re-priced on 4,096); COMM_SEND / COMM_RECV cost one message on the outermost
dimension of more than one NPU (none on one NPU). ``comm_size`` is read as the bytes each rank
puts in (required but for a BARRIER): the vector for ALL_REDUCE and REDUCE_SCATTER, its own
piece for ALL_GATHER and GATHER (the result is ``npus`` times that), what it sends in all for
ALL_TO_ALL, the message for BROADCAST; a BARRIER costs an all-reduce of one float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scaleout.scheduler.plan import plan_and_policy
from scaleout.sim.chakra import attributes, check_nodes, load_schema, make_attr
from scaleout.sim.collectives import collective_cost
from scaleout.sim.config import IterationConfig
from scaleout.sim.events import EventQueue
from scaleout.sim.iteration import Span, plan_items
from scaleout.sim.network import Topology
from scaleout.sim.workload import Workload

__all__ = ["GraphResult", "chakra_nodes", "run_graph"]

_COLL_OPS = {
    "ALL_REDUCE": "allreduce",
    "ALL_GATHER": "allgather",
    "REDUCE_SCATTER": "reduce_scatter",
    "BROADCAST": "broadcast",
    "ALL_TO_ALL": "alltoall",
    "REDUCE": "broadcast",  # its mirror image (gamma = 0); see _COLL_OPS' note below
    "GATHER": "allgather",
    "SCATTER": "reduce_scatter",
    "REDUCE_SCATTER_BLOCK": "reduce_scatter",
}
# A REDUCE is a broadcast run backwards (the same steps and bytes, no reduction cost): the root
# ends with all n bytes reduced, so it pays at least n/B (Chan et al. 2007's lower bound), as a
# broadcast does. Until stop 52 it was priced as a reduce-scatter, (p-1)/p n/B: 3 s, not 6 s,
# for 4 bytes on a ring of 4 at 1 B/s. GATHER and SCATTER move what ALL_GATHER and
# REDUCE_SCATTER move through the root's link, (p-1)/p of the whole: priced as those (a choice:
# a linear gather pays p-1 latencies where a ring all-gather pays p-1 steps too).


@dataclass(frozen=True, kw_only=True)
class GraphResult:
    """An executed graph: ``time`` until its last node ended, busy seconds per resource, spans."""

    time: float
    compute_s: float
    comm_s: float
    nodes: int
    spans: tuple[Span, ...]


def chakra_nodes(workload: Workload, config: IterationConfig | None = None) -> list[Any]:
    """One iteration of ``workload`` as Chakra ``Node`` messages (the same for every rank)."""
    config = config or IterationConfig()
    schema = load_schema()
    comp, coll = schema.NodeType.Value("COMP_NODE"), schema.NodeType.Value("COMM_COLL_NODE")
    nodes: list[Any] = []

    def add(
        name: str,
        kind: int,
        seconds: float,
        data: Sequence[int],
        ctrl: Sequence[int] = (),
        **attrs: object,
    ) -> int:
        node = schema.Node(
            id=len(nodes),
            name=name,
            type=kind,
            data_deps=list(data),
            ctrl_deps=list(ctrl),
            duration_micros=int(round(seconds * 1e6)),
        )
        node.attr.append(make_attr("duration_s", float(seconds)))
        for key, value in attrs.items():
            node.attr.append(make_attr(key, value))
        nodes.append(node)
        return node.id

    layers = workload.layers
    fwd = []
    for layer in layers:
        fwd.append(add(f"forward {layer.name}", comp, layer.forward_s, fwd[-1:]))
    bwd: dict[int, int] = {}
    previous = fwd[-1]
    for i in reversed(range(len(layers))):
        previous = bwd[i] = add(
            f"backward {layers[i].name}", comp, layers[i].backward_s, [previous]
        )
    items = plan_items(layers, config)
    comms: list[int] = []
    codec = config.codec
    comm_type = schema.CollectiveCommType.Value("ALL_REDUCE" if codec.summable else "ALL_GATHER")
    plans, scheduler = plan_and_policy(items, config.scheduler)
    lanes = scheduler.lanes
    for plan in plans:
        wire = int(round(plan.nbytes * codec.ratio))
        comms.append(
            add(
                f"bucket{plan.index}",
                coll,
                0.0,
                [bwd[min(plan.keys)]],
                comms[-1:],
                comm_type=comm_type,
                comm_size=wire,
                comm_priority=lanes - 1 - plan.lane,
                codec_s=plan.nbytes * codec.seconds_per_byte,
            )
        )
    updates = sum(lay.update_s for lay in layers if lay.grad_bytes)
    add("update", comp, updates, [bwd[0], *comms])
    return nodes


def _seconds(node: Any, attrs: dict) -> float:
    return float(attrs.get("duration_s", node.duration_micros * 1e-6))


def _point_to_point(topology: Topology, nbytes: float) -> float:
    """One message on the outermost dimension that has links (more than one NPU); 0 s on one
    NPU. The last dimension alone priced an ``8x1`` machine's send on a link that does not
    exist (``with_npus`` leaves size-1 dimensions: ``8x128`` resized to 8 is ``8x1``)."""
    active = [dim for dim in topology.dims if dim.npus > 1]
    return active[-1].message_time(nbytes) if active else 0.0


def run_graph(
    nodes: Sequence[Any],
    topology: Topology,
    *,
    algorithm: str | tuple[str, ...] = "ring",
    flat: bool = False,
) -> GraphResult:
    """Execute one rank's Chakra nodes on ``topology``.

    Raises:
        ValueError: nodes that :func:`~scaleout.sim.chakra.check_nodes` refuses (none, a
            repeated id, a dependency on a missing node, a cycle, an unsound attribute), or an
            unpriced collective type.
    """
    schema = load_schema()
    check_nodes(nodes)
    by_id = {node.id: node for node in nodes}
    waiting_on: dict[int, int] = {}
    children: dict[int, list[int]] = {i: [] for i in by_id}
    for node in nodes:
        deps = set(node.data_deps) | set(node.ctrl_deps)
        waiting_on[node.id] = len(deps)
        for dep in deps:
            children[dep].append(node.id)
    q = EventQueue()
    ready: dict[str, list[int]] = {"compute": [], "comm": []}
    busy = {"compute": False, "comm": False}
    totals = {"compute": 0.0, "comm": 0.0}
    spans: list[Span] = []
    finished = [0]

    def cost(node: Any, attrs: dict) -> tuple[str, float]:
        kind = schema.NodeType.Name(node.type)
        if kind == "COMM_COLL_NODE":
            ctype = schema.CollectiveCommType.Name(int(attrs.get("comm_type", 0)))
            if ctype == "BARRIER":  # priced as an all-reduce of one float: its latency
                return "comm", collective_cost(
                    topology, op="allreduce", algorithm=algorithm, nbytes=4, flat=flat
                ).time
            if ctype not in _COLL_OPS:
                raise ValueError(f"node {node.id}: collective type {ctype} is not priced")
            size = float(attrs.get("comm_size", 0))
            if ctype in ("ALL_GATHER", "GATHER"):  # comm_size is what each rank contributes
                size *= topology.npus
            price = collective_cost(
                topology, op=_COLL_OPS[ctype], algorithm=algorithm, nbytes=size, flat=flat
            )
            return "comm", price.time + float(attrs.get("codec_s", 0.0))
        if kind in ("COMM_SEND_NODE", "COMM_RECV_NODE"):
            return "comm", _point_to_point(topology, float(attrs.get("comm_size", 0)))
        return "compute", _seconds(node, attrs)

    def start(resource: str) -> None:
        if busy[resource] or not ready[resource]:
            return
        queue = ready[resource]
        if resource == "comm":
            queue.sort(key=lambda i: (-int(attributes(by_id[i]).get("comm_priority", 0)), i))
        else:
            queue.sort()
        node_id = queue.pop(0)
        node = by_id[node_id]
        _, seconds = cost(node, attributes(node))
        busy[resource] = True
        totals[resource] += seconds
        begin = q.now

        def done() -> None:
            busy[resource] = False
            finished[0] += 1
            if q.now > begin:
                spans.append(Span(resource, node.name, begin, q.now, 0))
            for child in children[node_id]:
                waiting_on[child] -= 1
                if waiting_on[child] == 0:
                    release(child)
            start("compute")
            start("comm")

        q.after(seconds, done)

    def release(node_id: int) -> None:
        node = by_id[node_id]
        resource, _ = cost(node, attributes(node))
        ready[resource].append(node_id)
        start(resource)

    for node_id, count in waiting_on.items():
        if count == 0:
            release(node_id)
    end = q.run()
    if finished[0] != len(nodes):
        raise RuntimeError(f"{len(nodes) - finished[0]} checked Chakra nodes never ran")
    return GraphResult(
        time=end,
        compute_s=totals["compute"],
        comm_s=totals["comm"],
        nodes=len(nodes),
        spans=tuple(spans),
    )
