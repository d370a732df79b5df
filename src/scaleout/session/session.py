"""Session: the operations of one model, committed into a persistent communication plan."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from scaleout.core.communicator import Communicator
from scaleout.core.consistency import verify_plan
from scaleout.core.distribution import Distribution
from scaleout.core.env import Environment
from scaleout.core.grid import GroupType
from scaleout.scheduler import (PlanItem, ProgressEngine, SchedulerConfig, make_policy,
                                plan_and_policy)
from scaleout.session.activation import ActivationSpec
from scaleout.session.bucket import CommHook, GradBucket, scheduler_as_run
from scaleout.session.hooks import (CodecHookState, allreduce_hook, codec_hook, codec_identity,
                                    other_codec, reduce_scatter_hook)
from scaleout.session.operation import Operation
from scaleout.session.parameter_set import ParameterSet, ParameterSetSpec
from scaleout.session.statistics import Statistics
from scaleout.session.trace import TraceRecorder

__all__ = ["Phase", "Session"]


class Phase(enum.Enum):
    """TRAIN sessions communicate gradients; TEST sessions only activations."""

    TRAIN = "train"
    TEST = "test"


class Session:
    """MLSL's Session: register operations, ``commit()`` once, then communicate per iteration.

    Args:
        env: the Environment.
        phase: TRAIN (gradients are communicated) or TEST.
        scheduler: how gradients are fused, split and prioritised.
        trace: a :class:`~scaleout.session.trace.TraceRecorder` that records a timeline of
            compute, communication and waits; ``None``: none (``DataParallel(trace=folder)``
            records into a folder).

    Raises:
        TypeError: ``phase``, ``scheduler`` or ``trace`` of the wrong type.

    Example (every rank):
        >>> session = Session(env, Phase.TRAIN)
        >>> session.set_global_minibatch_size(64)
        >>> op = session.add_operation("fc1", dist, parameter_sets=[ParameterSetSpec(count=4096)])
        >>> session.commit()
        >>> ps = op.parameter_sets[0]
        >>> ps.start_gradient_comm(grad); ...; avg = ps.wait_gradient_comm()
        >>> session.statistics.end_iteration()  # a step ended: statistics.table() per step
    """

    def __init__(self, env: Environment, phase: Phase = Phase.TRAIN, *,
                 scheduler: SchedulerConfig | None = None,
                 trace: TraceRecorder | None = None) -> None:
        if not isinstance(phase, Phase):
            raise TypeError(f"phase must be a scaleout Phase, got {phase!r}")
        if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
            raise TypeError(f"scheduler must be a SchedulerConfig, got {type(scheduler).__name__}")
        if trace is not None and not isinstance(trace, TraceRecorder):
            raise TypeError(f"trace must be a scaleout TraceRecorder or None, got {trace!r}; "
                            "to write a trace into a folder, use DataParallel(trace=folder)")
        self.env = env
        self.phase = phase
        self.scheduler = scheduler or SchedulerConfig()
        self.statistics = Statistics(trace)
        self._operations: list[Operation] = []
        self._global_minibatch: int | None = None
        self._committed = False
        self._engines: list[ProgressEngine] = []
        self._duplicates: list[tuple[Distribution, Communicator]] = []  # (close)
        self._hook: tuple[Any, CommHook] | None = None
        self.buckets: list[GradBucket] = []
        #: The policy each distribution's plan runs under, in commit order (an open policy
        #: as decided at commit: ``"fifo"`` or ``"priority"``).
        self.policies: list[str] = []

    @property
    def operations(self) -> tuple[Operation, ...]:
        return tuple(self._operations)

    @property
    def committed(self) -> bool:
        return self._committed

    @property
    def global_minibatch_size(self) -> int | None:
        return self._global_minibatch

    def set_global_minibatch_size(self, size: int) -> None:
        """Set the global minibatch size, once.

        Raises:
            ValueError: set twice, not positive, or not divisible by an operation's
                data-group size.
        """
        if self._global_minibatch is not None:
            raise ValueError(f"the global minibatch size is already set "
                             f"({self._global_minibatch}); it can be set once")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"global minibatch size must be an int >= 1, got {size!r}")
        for op in self._operations:
            self._check_divides(size, op.distribution)
        self._global_minibatch = size

    @staticmethod
    def _check_divides(size: int, distribution: Distribution) -> None:
        data = distribution.size(GroupType.DATA)
        if size % data != 0:
            raise ValueError(f"global minibatch size {size} must be divisible by the data-group "
                             f"size {data}")

    def local_minibatch_size(self, distribution: Distribution) -> int:
        """Global minibatch size / ``distribution``'s data-group size."""
        if self._global_minibatch is None:
            raise ValueError("set_global_minibatch_size() has not been called")
        return self._global_minibatch // distribution.size(GroupType.DATA)

    def add_operation(self, name: str, distribution: Distribution, *,
                      parameter_sets: Sequence[ParameterSetSpec] = (),
                      inputs: Sequence[ActivationSpec] = (),
                      outputs: Sequence[ActivationSpec] = ()) -> Operation:
        """Register a layer (in forward order). Must happen before ``commit()``."""
        if self._committed:
            raise RuntimeError(f"add_operation({name!r}): the session is already committed")
        if not isinstance(name, str) or not name:
            raise ValueError(f"operation name must be a non-empty string, got {name!r}")
        if any(op.name == name for op in self._operations):
            raise ValueError(f"an operation named {name!r} is already registered")
        if self._global_minibatch is not None:
            self._check_divides(self._global_minibatch, distribution)
        op = Operation(len(self._operations), name, distribution, parameter_sets, inputs,
                       outputs, statistics=self.statistics,
                       local_minibatch=self.local_minibatch_size)
        taken = [ps.name for earlier in self._operations for ps in earlier.parameter_sets]
        for ps in op.parameter_sets:  # statistics, errors and a codec's saved state name them
            if ps.name in taken:
                raise ValueError(f"operation {name!r}: a parameter set named {ps.name!r} is "
                                 f"already registered (each set's name must be unique: its "
                                 f"codec state is saved under it)")
            taken.append(ps.name)
        if self._operations:
            op.prev, self._operations[-1].next = self._operations[-1], op
        self._operations.append(op)
        return op

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Send every bucket with ``hook(state, bucket)`` instead of the built-in exchange.

        The contract is DDP's: the hook returns a request (or a ``torch.futures.Future``)
        whose result is the bucket's flat gradient averaged over the data group; torch's own
        ``ddp_comm_hooks`` run unchanged. Buckets then travel one at a time on one lane in
        backward order, so a hook may use any process group (``state`` picks it, like in
        DDP) without two ranks ever ordering its collectives differently. ``state=None`` is
        given to the hook as the lane's own process group over the data group (since stop
        52): torch's hooks read None as the default group, which spans the model group too
        on a grid (tensor-parallel shards averaged with each other's) and which the user's
        thread uses too (the progress thread's sends and the user's collectives could meet
        it in another order on each rank and both wait out the timeout).

        Raises:
            RuntimeError: after ``commit()``.
            TypeError: ``hook`` is not callable.
        """
        if self._committed:
            raise RuntimeError("register_comm_hook must be called before commit()")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._hook = (state, hook)

    def commit(self) -> None:
        """Build the communication plan once: buckets, lanes, buffers and the engines.

        Every rank must call it after registering the same operations in the same order.
        A commit that raises leaves the session uncommitted (nothing of it is kept).

        Raises:
            RuntimeError: already committed.
            ValueError: one distribution's parameter sets live on different GPUs, or the
                ranks registered different bucket plans.
        """
        if self._committed:
            raise RuntimeError("the session is already committed")
        self.env.require_alive()
        all_sets = [ps for op in self._operations for ps in op.parameter_sets]
        if self.phase is not Phase.TRAIN:
            for ps in all_sets:
                ps.test_phase = True
            self._committed = True
            return
        by_dist: dict[int, list[ParameterSet]] = {}
        dists: dict[int, Distribution] = {}
        for op in self._operations:
            for ps in op.parameter_sets:
                by_dist.setdefault(id(op.distribution), []).append(ps)
                dists[id(op.distribution)] = op.distribution
        try:
            for key, sets in by_dist.items():
                self._commit_distribution(dists[key], sets)
        except BaseException:
            self.close()  # the engines of the distributions already built
            self.buckets.clear()
            for ps in all_sets:
                ps.bucket = ps.increment_comm = None
            raise
        self._committed = True

    def _commit_distribution(self, dist: Distribution, sets: list[ParameterSet]) -> None:
        devices = {ps.spec.device for ps in sets if ps.spec.device.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"the parameter sets of one distribution must live on one GPU, "
                             f"got {sorted(map(str, devices))}")
        device = next(iter(devices), torch.device("cpu"))
        config = scheduler_as_run(self.scheduler, dist.communicator(GroupType.DATA), device,
                                  self.env.launch.one_machine)
        if self._hook is not None:  # one lane, fixed order: see register_comm_hook
            config = replace(config, policy="fifo", channels=1)
        codecs = [_codec_of(ps) for ps in sets]  # chosen once, here
        items = [PlanItem(key=k, numel=ps.local_count,
                          dtype=str(ps.spec.dtype).removeprefix("torch."),
                          elem_bytes=ps.spec.dtype.itemsize,
                          position=ps.op_index * 1000 + ps.index,
                          fusible=not ps.spec.distributed_update,
                          codec="" if codec is None else repr(codec))
                 for k, (ps, codec) in enumerate(zip(sets, codecs))]
        plans, config = plan_and_policy(items, config)  # (an open policy decided by the plan)
        if dist.size(GroupType.DATA) > 1:  # once per plan: every rank must send the same buckets
            verify_plan(dist.communicator(GroupType.DATA), "bucket plan",
                        [(plan.keys, plan.numel, plan.dtype, plan.lane, plan.codec, plan.fused)
                         for plan in plans])
        channels = config.channels or 1
        self.policies.append(str(config.policy))
        lanes = [self._duplicate(dist, f"data-lane{i}") for i in range(config.lanes)]
        extra = {(i, c): self._duplicate(dist, f"data-lane{i}-channel{c}")
                 for i in range(config.lanes) for c in range(1, channels)}
        # its own process group only where a sharded update all-gathers increments: every
        # idle gloo group keeps a thread that wakes 100 times a second (`fused` in the plan
        # checked above says alike on every rank whether one is made)
        increments = (self._duplicate(dist, "data-increments")
                      if any(ps.spec.distributed_update for ps in sets) else None)
        lengths = [0] * config.lanes
        buckets = []
        for plan in plans:
            members = [sets[k] for k in plan.keys]
            head, codec = members[0], codecs[plan.keys[0]]
            size = lanes[plan.lane].size
            channel = lengths[plan.lane] % channels  # a lane's buckets take the channels in turn
            comm = lanes[plan.lane] if channel == 0 else extra[plan.lane, channel]
            numel = head.owned_count * size if head.spec.distributed_update else plan.numel
            state, hook = self._hook or self._builtin_hook(members, codec)
            if self._hook is not None and state is None:  # see register_comm_hook
                state = comm.group
            bucket = GradBucket(
                index=plan.index, lane=plan.lane, order=lengths[plan.lane], members=members,
                offsets=plan.offsets, numel=numel, dtype=head.spec.dtype,
                device=head.spec.device, comm=comm, hook=hook, state=state,
                chunks=plan.chunks, last=plan.index == len(plans) - 1,
                exclusive=self._hook is not None or (codec is not None and codec.multi_round),
                statistics=self.statistics)
            lengths[plan.lane] += 1
            for ps in members:
                ps.bucket, ps.increment_comm = bucket, increments
            buckets.append(bucket)
        stream = torch.cuda.Stream(device=devices.pop()) if devices else None
        engine = ProgressEngine(lanes, [max(n, 1) for n in lengths], make_policy(config, channels),
                                self.env.timeout, stream=stream)
        for bucket in buckets:
            bucket.engine, bucket.stream = engine, stream
        self._engines.append(engine)
        self.buckets.extend(buckets)

    def _duplicate(self, dist: Distribution, name: str) -> Communicator:
        """A communicator of its own over ``dist``'s data group (kept for :meth:`close`)."""
        comm = dist.duplicate(GroupType.DATA, name)
        self._duplicates.append((dist, comm))
        return comm

    @staticmethod
    def _builtin_hook(members: list[ParameterSet], codec: Any) -> tuple[Any, CommHook]:
        head = members[0]
        if codec is not None:
            return CodecHookState(codec=codec, shapes=[ps.shape for ps in members],
                                  warmup_steps=head.spec.compression.warmup_steps), codec_hook
        if head.spec.distributed_update:
            return None, reduce_scatter_hook
        return None, allreduce_hook

    def compressed_buckets(self) -> dict[str, Any]:
        """The buckets a codec compresses, by name (their parameter sets' names joined with
        ``+``)."""
        return {b.name: b for b in self.buckets if isinstance(b.state, CodecHookState)}

    def compression_state_dict(self) -> dict[str, Any]:
        """Every compressed bucket's codec state (error-feedback residuals, ...) and its codec
        (:func:`~scaleout.session.hooks.codec_identity`), by bucket name
        (:meth:`compressed_buckets`)."""
        return {name: {"states": {name: bucket.state.codec_state.state_dict()},
                       "codec": codec_identity(bucket.state.codec)}
                for name, bucket in self.compressed_buckets().items()}

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`compression_state_dict` returned.

        Raises:
            ValueError: the state names parameter sets this session does not compress, or
                was saved by another codec (another codec's residuals, momentum or PowerSGD
                factors would be taken for this one's; state saved before stop 49 names no
                codec and loads).
        """
        compressed = self.compressed_buckets()
        unknown = sorted(set(state) - set(compressed))
        if unknown:
            raise ValueError(f"compression state for buckets this session does not have: "
                             f"{unknown}; it has {sorted(compressed)}")
        for name, entry in state.items():
            if not isinstance(entry, dict) or name not in entry.get("states", {}):
                raise ValueError(f"compression state of bucket {name!r} must be "
                                 f"{{'states': {{{name!r}: codec state}}}}")
            if other_codec(entry, compressed[name]):
                raise ValueError(f"the compression state of bucket {name!r} was saved by "
                                 f"{entry['codec']}, and this session compresses it with "
                                 f"{codec_identity(compressed[name].state.codec)}")
            compressed[name].state.codec_state.load_state_dict(entry["states"][name])

    def close(self, *, reuse: bool = False) -> None:
        """Stop the progress engines; with ``reuse`` (on every rank, nothing in flight: a
        session planned again) hand its communicators back to their distributions for the
        next session's lanes (:meth:`~scaleout.core.Distribution.reuse`)."""
        for engine in self._engines:
            engine.close()
        self._engines.clear()
        for dist, comm in self._duplicates:  # (without reuse: freed, stop 52)
            if reuse:
                dist.reuse(GroupType.DATA, comm)
            else:
                dist.release(comm)
        self._duplicates.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _codec_of(ps: ParameterSet) -> Any:
    """The codec ``ps`` is compressed with once warmed up, or ``None`` if it goes exact."""
    config = ps.spec.compression  # a CompressionConfig, parsed by the spec
    if config is None:
        return None
    return config.codec_for(ps.name, ps.local_count, ps.spec.dtype)
