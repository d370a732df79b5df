"""One data-parallel training iteration, driven by the runtime's own scheduling objects.

The plan is :func:`scaleout.scheduler.plan_and_policy` on the workload's layers (fusion into
buckets, lanes, chunks; an open policy decided as the runtime decides it), and the order in
which chunks go on the wire is decided by the policy object of
:func:`scaleout.scheduler.make_policy` (FIFO like DDP, or priority lanes
with chunk pre-emption and a credit), given the same :class:`~scaleout.scheduler.LaneState`
the progress engine gives it. Ranks are symmetric in data parallelism, so one rank is
simulated and each chunk is priced as a collective over the whole topology
(:func:`~scaleout.sim.collectives.collective_cost`): that is what makes 4,096 nodes cheap.

Model, per rank:

* one compute stream: forward layers 0..L-1, backward L-1..0; a bucket's chunk is ready
  when the backward of the layers it needs ends (:func:`~scaleout.scheduler.chunk_needs`:
  the front of a bucket leaves while backward still produces its back, as the runtime's
  buckets release it);
* one network: issued chunks are served one at a time, in issue order (so an urgent chunk
  waits behind the bulk bytes already issued: at most one credit under the priority policy);
  a chunk costs its collective's time on the compressed bytes plus the codec's compute;
  with ``host_s_per_byte`` (a host whose CPU moves the bytes) the wire bytes' CPU and the
  codec's run on the compute's cores: their share done while the rank computes lengthens
  its compute (processor sharing);
* ``mode="sync"`` (DDP): the next iteration starts when every bucket arrived and every
  update ran; ``mode="overlap"`` (scaleout): the next forward of layer ``i`` waits only for
  layer ``i``'s bucket, then runs its update and its forward.

Several iterations run back to back and the steady state is reported: iteration time,
exposed communication (iteration - compute), scaling efficiency (compute / iteration, i.e.
against one rank that never communicates), per-dimension link utilisation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from scaleout.scheduler.plan import PlanItem, plan_and_policy
from scaleout.scheduler.policy import LaneState, make_policy
from scaleout.sim.collectives import CollectiveCost, collective_cost
from scaleout.sim.config import IterationConfig
from scaleout.sim.events import EventQueue
from scaleout.sim.lanes import Chunk, LaneQueues
from scaleout.sim.network import Topology
from scaleout.sim.result import IterationResult, Span
from scaleout.sim.themis import pipelined_algorithm, pipelined_allreduce
from scaleout.sim.workload import Workload

__all__ = ["Span", "IterationResult", "simulate"]


def plan_items(layers: Sequence[Any], config: IterationConfig) -> list[PlanItem]:
    """The scheduler's plan items of the layers with gradients (bytes, in forward order):
    what the runtime's bucket planner fuses, here and in the Chakra graph."""
    return [PlanItem(key=i, numel=layer.grad_bytes, dtype="bytes", elem_bytes=1, position=i,
                     codec=config.codec_of(layer.name).name)
            for i, layer in enumerate(layers) if layer.grad_bytes > 0]


class _Run:
    """The state of one simulation (one object per :func:`simulate` call)."""

    def __init__(self, workload: Workload, topology: Topology, config: IterationConfig) -> None:
        self.w, self.topo, self.cfg = workload, topology, config
        items = plan_items(workload.layers, config)
        self.plans, sched = plan_and_policy(items, config.scheduler)  # (as the runtime plans)
        self.policy = make_policy(sched)
        self.buckets_of: dict[int, list[int]] = {}
        for plan in self.plans:
            for key in plan.keys:
                self.buckets_of.setdefault(key, []).append(plan.index)
        self.q = EventQueue()
        self.queues = LaneQueues(self.plans, sched.lanes, config.early_chunks)
        self.lanes = self.queues.queues
        self.inflight = [0] * sched.lanes
        self.inflight_bytes = [0] * sched.lanes
        self.blocking = [0] * sched.lanes  # multi-round exchanges in flight (they own the lane)
        self.codecs = [config.codec_of(layer.name) for layer in workload.layers]
        self.net: deque[Chunk] = deque()
        self.net_busy = False
        self.left: dict[tuple[int, int], int] = {}  # (iteration, bucket) -> chunks not done
        self.done_at: dict[tuple[int, int], float] = {}
        self.waiter: tuple[tuple[int, int], Callable[[], None]] | None = None
        self.costs: dict[float, CollectiveCost] = {}
        self.spans: list[Span] = []
        self.starts: list[float] = []
        self.comm_s = 0.0
        self.busy = [0.0] * len(topology.dims)
        self.computed = 0.0  # compute seconds done before ``computing`` (processor sharing)
        self.computing: float | None = None  # start of the compute span running now
        self.debt = 0.0  # host work owed to the next compute span
        # a cycled loop (``cycle_s``): its last cycle's start, when that cycle's work ended,
        # the chunks it admitted that are not sent yet, and whether a tick is scheduled
        self.cycle_at = self.cycle_free = 0.0
        self.admitted = 0
        self.ticking = False

    def compute_clock(self) -> float:
        """Seconds this rank has computed so far (the running span included)."""
        running = self.q.now - self.computing if self.computing is not None else 0.0
        return self.computed + running

    # -- network ---------------------------------------------------------------------------
    def wire(self, chunk: Chunk) -> tuple[float, float, bool]:
        """``(wire bytes, codec seconds, summable)`` of a chunk: an exact chunk as it is, a
        compressed bucket (always whole) by each of its layers' codec."""
        if not chunk.bucket.codec:
            return float(chunk.nbytes), 0.0, True
        layers, codecs = self.w.layers, self.codecs
        wire = sum(layers[k].grad_bytes * codecs[k].ratio for k in chunk.bucket.keys)
        seconds = sum(layers[k].grad_bytes * codecs[k].seconds_per_byte for k in chunk.bucket.keys)
        return wire, seconds, codecs[chunk.bucket.keys[0]].summable

    def cost(self, wire: float, summable: bool = True) -> CollectiveCost:
        """The collective that carries ``wire`` bytes (all-reduced, else all-gathered)."""
        if (wire, summable) not in self.costs:
            op, size = (
                ("allreduce", wire) if summable else ("allgather", wire * self.topo.npus)
            )
            active = sum(d.npus > 1 for d in self.topo.dims)
            if self.cfg.pipeline and op == "allreduce" and active > 1:
                piped = pipelined_allreduce(
                    self.topo,
                    nbytes=size,
                    chunks=self.cfg.pipeline_chunks,
                    algorithm=pipelined_algorithm(self.cfg.algorithm),
                    scheduler=self.cfg.pipeline,
                )
                self.costs[wire, summable] = CollectiveCost(
                    op=op,
                    algorithm=f"{self.cfg.pipeline}-pipelined",
                    nbytes=size,
                    npus=self.topo.npus,
                    time=piped.time,
                    phases=(),
                    link_busy=piped.busy,
                )
                return self.costs[wire, summable]
            self.costs[wire, summable] = collective_cost(
                self.topo, op=op, algorithm=self.cfg.algorithm, nbytes=size, flat=self.cfg.flat
            )
        return self.costs[wire, summable]

    def dispatch(self) -> None:
        while True:
            states = [
                LaneState(
                    queued=len(q),
                    next_bytes=q[0].nbytes if q else 0,
                    inflight=self.inflight[i],
                    inflight_bytes=self.inflight_bytes[i],
                    blocked=self.blocking[i] > 0,
                )
                for i, q in enumerate(self.lanes)
            ]
            lane = self.policy.choose(states)
            if lane is None:
                return
            chunk = self.lanes[lane].popleft()
            self.inflight[lane] += 1
            self.inflight_bytes[lane] += chunk.nbytes
            self.blocking[lane] += self.multi_round(chunk)
            self.net.append(chunk)
            self.serve()

    def multi_round(self, chunk: Chunk) -> bool:
        return bool(chunk.bucket.codec) and self.codecs[chunk.bucket.keys[0]].multi_round

    def next_tick(self) -> float:
        """When the cycled loop next starts a cycle: one ``cycle_s`` after the last cycle
        started, or when its work ended if later; idle cycles follow every ``cycle_s``."""
        cycle, now = self.cfg.cycle_s, self.q.now
        start = max(self.cycle_at + cycle, self.cycle_free)
        if start >= now:
            return start
        return start + cycle * math.ceil((now - start) / cycle - 1e-9)

    def serve(self) -> None:
        if self.net_busy or not self.net or self.ticking:
            return
        if self.cfg.cycle_s and not self.admitted:  # a cycle takes what is queued at its start
            tick = self.next_tick()
            if tick > self.q.now:
                self.ticking = True

                def cycle() -> None:
                    self.ticking = False
                    self.serve()

                self.q.after(tick - self.q.now, cycle)
                return
            self.cycle_at, self.admitted = self.q.now, len(self.net)
        chunk = self.net.popleft()
        self.admitted = max(self.admitted - 1, 0)
        wire, codec_s, summable = self.wire(chunk)
        cost = self.cost(wire, summable)
        rounds = self.codecs[chunk.bucket.keys[0]].rounds if chunk.bucket.codec else 1
        # the CPU the wire bytes and each round's call cost (testbed, a tuned CPU run)
        host = wire * self.cfg.host_s_per_byte + rounds * self.cfg.host_s_per_message
        duration = max(cost.time + (rounds - 1) * self.cost(1.0).time, host) + codec_s
        # on such a host the codec runs on the compute's cores too: its share done while the
        # rank computes is charged the same way
        cpu = host + (codec_s if self.cfg.host_s_per_byte else 0.0)
        self.net_busy = True
        start, clock = self.q.now, self.compute_clock()
        if chunk.iteration == 1:  # a steady-state iteration's traffic, counted once
            self.comm_s += duration
            self.busy = [b + c for b, c in zip(self.busy, cost.link_busy)]

        def finish() -> None:
            self.net_busy = False
            if not self.admitted:  # (a cycled loop: this cycle's work is done)
                self.cycle_free = self.q.now
            if cpu and duration > 0:  # the host work done while the rank computed
                self.debt += cpu * (self.compute_clock() - clock) / duration
            lane = chunk.bucket.lane
            self.inflight[lane] -= 1
            self.inflight_bytes[lane] -= chunk.nbytes
            self.blocking[lane] -= self.multi_round(chunk)
            self.record("comm", f"bucket{chunk.bucket.index}", start, chunk.iteration)
            key = (chunk.iteration, chunk.bucket.index)
            self.left[key] -= 1
            if self.left[key] == 0:
                self.done_at[key] = self.q.now
                if self.waiter is not None and self.ready(*self.waiter[0]):
                    resume = self.waiter[1]
                    self.waiter = None
                    resume()
            self.dispatch()
            self.serve()

        self.q.after(duration, finish)

    # -- compute ---------------------------------------------------------------------------
    def record(self, lane: str, name: str, start: float, iteration: int) -> None:
        if self.cfg.trace and self.q.now > start:
            self.spans.append(Span(lane, name, start, self.q.now, iteration))

    def ready(self, iteration: int, layer: int) -> bool:
        """Layer ``layer``'s buckets of ``iteration`` all arrived (layer -1: every bucket)."""
        if iteration < 0:
            return True
        indices = range(len(self.plans)) if layer < 0 else self.buckets_of.get(layer, ())
        return all((iteration, b) in self.done_at for b in indices)

    def compute(self, name: str, seconds: float, iteration: int, then: Callable[[], None]) -> None:
        start, self.computing = self.q.now, self.q.now
        seconds, self.debt = seconds + self.debt, 0.0

        def end() -> None:
            self.computed += self.q.now - start
            self.computing = None
            self.record("compute", name, start, iteration)
            then()

        self.q.after(seconds, end)

    def wait(self, iteration: int, layer: int, then: Callable[[], None]) -> None:
        if self.ready(iteration, layer):
            then()
            return
        start = self.q.now
        self.waiter = (
            (iteration, layer),
            lambda: (self.record("wait", "wait", start, iteration + 1), then()),
        )

    def forward(self, it: int, i: int) -> None:
        layers = self.w.layers
        if it == self.cfg.iterations:  # the boundary: when a next iteration could start
            if self.cfg.mode == "overlap":
                self.wait(it - 1, 0, lambda: self.starts.append(self.q.now))
            else:
                self.starts.append(self.q.now)
            return
        if i == len(layers):
            self.backward(it, len(layers) - 1)
            return
        if self.cfg.mode == "overlap":

            def go() -> None:
                if i == 0:
                    self.starts.append(self.q.now)
                update = layers[i].update_s if it > 0 and layers[i].grad_bytes else 0.0
                self.compute(
                    f"forward {layers[i].name}",
                    update + layers[i].forward_s,
                    it,
                    lambda: self.forward(it, i + 1),
                )

            self.wait(it - 1, i, go)
        else:
            if i == 0:
                self.starts.append(self.q.now)
            self.compute(
                f"forward {layers[i].name}",
                layers[i].forward_s,
                it,
                lambda: self.forward(it, i + 1),
            )

    def backward(self, it: int, i: int) -> None:
        if i < 0:
            if self.cfg.mode == "overlap":
                self.forward(it + 1, 0)
            else:
                updates = sum(layer.update_s for layer in self.w.layers if layer.grad_bytes)
                self.wait(
                    it,
                    -1,
                    lambda: self.compute("update", updates, it, lambda: self.forward(it + 1, 0)),
                )
            return
        layer = self.w.layers[i]

        def produced() -> None:
            for plan in self.queues.produced(it, i):
                self.left.setdefault((it, plan.index), len(plan.chunks))
            self.dispatch()
            self.backward(it, i - 1)

        self.compute(f"backward {layer.name}", layer.backward_s, it, produced)

    def run(self) -> IterationResult:
        self.forward(0, 0)
        self.q.run()
        starts = self.starts
        iteration_s = (starts[-1] - starts[1]) / (len(starts) - 2)
        compute_s = self.w.compute_s
        return IterationResult(
            workload=self.w.name,
            npus=self.topo.npus,
            iteration_s=iteration_s,
            compute_s=compute_s,
            exposed_s=max(iteration_s - compute_s, 0.0),
            comm_s=self.comm_s,
            efficiency=compute_s / iteration_s if iteration_s > 0 else 1.0,
            utilisation=tuple(b / iteration_s if iteration_s > 0 else 0.0 for b in self.busy),
            buckets=len(self.plans),
            chunks=sum(len(p.chunks) for p in self.plans),
            spans=tuple(self.spans),
        )


def simulate(
    workload: Workload, topology: Topology, config: IterationConfig | None = None
) -> IterationResult:
    """Simulate ``config.iterations`` iterations of data-parallel training; report the steady one.

    Args:
        workload: per-rank layers (forward order).
        topology: the network; every NPU is one data-parallel rank.
        config: scheduling, overlap mode, algorithm, codec (defaults: priority, overlap, ring).

    Returns:
        The steady-state :class:`IterationResult`.

    Raises:
        TypeError: arguments of the wrong type.

    Example:
        >>> from scaleout.sim.network import parse_topology
        >>> from scaleout.sim.workload import Layer, Workload
        >>> w = Workload(name="toy", layers=(Layer(name="a", forward_s=1.0, backward_s=1.0,
        ...                                        grad_bytes=8),))
        >>> topo = parse_topology("2", bandwidths=[1.0])
        >>> from scaleout.scheduler.config import SchedulerConfig
        >>> cfg = IterationConfig(scheduler=SchedulerConfig(policy="fifo"), mode="sync")
        >>> simulate(w, topo, cfg).iteration_s   # 1 + 1 + ring all-reduce 2 x 1 x 8/2
        10.0
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    return _Run(workload, topology, config or IterationConfig()).run()
