"""Session: the operations of one model, committed into a persistent communication plan."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator, ReduceOp
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.scheduler import Job, PlanItem, ProgressEngine, SchedulerConfig, build_plan, make_policy
from scaleout.session.activation import ActivationSpec
from scaleout.session.operation import Operation
from scaleout.session.parameter_set import ParameterSet, ParameterSetSpec
from scaleout.session.statistics import Statistics

if TYPE_CHECKING:
    from scaleout.core.env import Environment

__all__ = ["Phase", "Session"]


class Phase(enum.Enum):
    """TRAIN sessions communicate gradients; TEST sessions only activations."""

    TRAIN = "train"
    TEST = "test"


class _CommView:
    """The Distribution verbs over one communicator (what codecs exchange through)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                  group: GroupType) -> Any:
        return collectives.allreduce(self.comm, tensor, op)

    def allgather(self, tensor: torch.Tensor, *, group: GroupType) -> Any:
        return collectives.allgather(self.comm, tensor)

    def allgatherv(self, tensor: torch.Tensor, counts: Sequence[int], *, group: GroupType) -> Any:
        return collectives.allgatherv(self.comm, tensor, counts)

    def size(self, group: GroupType) -> int:
        return self.comm.size

    def rank(self, group: GroupType) -> int:
        return self.comm.rank


def _codec_of(ps: ParameterSet) -> Any:
    """The codec ``ps`` is compressed with once warmed up, or ``None`` if it goes exact."""
    spec = ps.spec.compression
    if spec is None:
        return None
    from scaleout.compression import CompressionConfig, NoneCodec

    config = spec if isinstance(spec, CompressionConfig) else CompressionConfig(codec=spec,
                                                                                min_numel=0)
    probe = torch.empty(_shape_of(ps), dtype=ps.spec.dtype)
    codec = config.select(ps.name, probe, step=config.warmup_steps)
    return None if isinstance(codec, NoneCodec) else codec


def _shape_of(ps: ParameterSet) -> tuple[int, ...]:
    """The gradient's shape on this rank (flat when the model group splits it)."""
    if ps.spec.shape and ps.local_count == ps.global_count:
        return tuple(ps.spec.shape)
    return (ps.local_count,)


def _bucket_compressor(ps: ParameterSet, codec: Any) -> Any:
    """One Compressor (one codec state) for a bucket whose members all use ``codec``."""
    from scaleout.compression import CompressionConfig, Compressor

    spec = ps.spec.compression
    warmup = spec.warmup_steps if isinstance(spec, CompressionConfig) else 0
    return Compressor(CompressionConfig(codec=codec, min_numel=0, warmup_steps=warmup))


class _Bucket:
    """A committed bucket: a flat buffer, its members, and the job that sends it."""

    def __init__(self, plan: Any, members: list[ParameterSet], codec: Any,
                 lanes: Sequence[Communicator], increment_comm: Communicator,
                 statistics: Statistics, rank: int, timeout: float) -> None:
        self.plan = plan
        self.members = members
        self.offsets = {id(ps): off for ps, off in zip(members, plan.offsets)}
        head = members[0]
        self.data_size = lanes[0].size
        self.sharded = head.spec.distributed_update
        self.compressor = None if codec is None else _bucket_compressor(head, codec)
        self.shapes = [_shape_of(ps) for ps in members]
        self.padded = head.owned_count * self.data_size if self.sharded else plan.numel
        self.buffer = torch.zeros(self.padded, dtype=head.spec.dtype)
        self.increment_comm = increment_comm
        self.statistics = statistics
        self.rank = rank
        self.timeout = timeout
        self._filled = 0
        self._out: list[Any] = [None]
        self.job = Job(name="+".join(ps.name for ps in members), lane=plan.lane,
                       order=0, chunks=self._chunks(), finish=self._finish,
                       exclusive=codec is not None and codec.multi_round)

    def _chunks(self) -> list[tuple[int, Any]]:
        if self.data_size == 1:
            return []
        size = self.plan.elem_bytes
        if self.compressor is not None:
            return [(self.padded * size, self._start_compressed)]
        if self.sharded:
            def start_rs(comm: Communicator) -> Any:
                request = collectives.reduce_scatter(comm, self.buffer, ReduceOp.SUM)
                self._out[0] = request
                return request
            return [(self.padded * size, start_rs)]
        chunks = []
        for begin, end in self.plan.chunks:
            view = self.buffer[begin:end]
            chunks.append(((end - begin) * size,
                           lambda comm, v=view: collectives.allreduce(comm, v, ReduceOp.SUM)))
        return chunks

    def _start_compressed(self, comm: Communicator) -> Any:
        # Non-blocking: the engine advances multi-round codecs (PowerSGD) round by round.
        request = self.compressor.allreduce(self.job.name, self.buffer, _CommView(comm),
                                            group=GroupType.DATA, average=True,
                                            shapes=self.shapes)
        self._out[0] = request
        return request

    def _finish(self) -> None:
        if self.data_size == 1:
            return
        nbytes = raw = self.plan.elem_bytes * self.padded
        if self.compressor is not None:
            nbytes = self._out[0].stats.payload_bytes
            self._out[0] = None
        elif self.sharded:
            self.buffer[: self.members[0].owned_count] = self._out[0].wait()
            self._out[0] = None
            self.buffer[: self.members[0].owned_count].div_(self.data_size)
        else:
            self.buffer.div_(self.data_size)
        elapsed = time.perf_counter() - self.job.issued_at if self.job.issued_at else 0.0
        share = 1.0 / len(self.members)
        for ps in self.members:
            self.statistics.add(ps.operation.name, comm_s=elapsed * share, bytes=nbytes * share,
                                raw_bytes=raw * share)

    def fill(self, ps: ParameterSet, flat: torch.Tensor) -> None:
        offset = self.offsets[id(ps)]
        self.buffer[offset: offset + flat.numel()].copy_(flat)
        self._filled += 1
        if self._filled == len(self.members):
            self._filled = 0
            self.job.completed_at = 0.0
            self.engine.submit(self.job)

    def wait(self, timeout: float | None) -> None:
        self.job.wait(self.timeout if timeout is None else timeout, self.rank)

    def result(self, ps: ParameterSet) -> torch.Tensor:
        if self.sharded:
            return self.buffer[: ps.owned_valid]
        offset = self.offsets[id(ps)]
        return self.buffer[offset: offset + ps.local_count]

    engine: ProgressEngine


class Session:
    """MLSL's Session: register operations, ``commit()`` once, then communicate per iteration.

    Args:
        env: the Environment.
        phase: TRAIN (gradients are communicated) or TEST.
        scheduler: how gradients are fused, split and prioritised.

    Example (every rank):
        >>> session = Session(env, Phase.TRAIN)
        >>> session.set_global_minibatch_size(64)
        >>> op = session.add_operation("fc1", dist, parameter_sets=[ParameterSetSpec(count=4096)])
        >>> session.commit()
        >>> ps = op.parameter_sets[0]
        >>> ps.start_gradient_comm(grad); ...; avg = ps.wait_gradient_comm()
    """

    def __init__(self, env: Environment, phase: Phase = Phase.TRAIN, *,
                 scheduler: SchedulerConfig | None = None) -> None:
        if not isinstance(phase, Phase):
            raise TypeError(f"phase must be a scaleout Phase, got {phase!r}")
        if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
            raise TypeError(f"scheduler must be a SchedulerConfig, got {type(scheduler).__name__}")
        self.env = env
        self.phase = phase
        self.scheduler = scheduler or SchedulerConfig()
        self.statistics = Statistics()
        self._operations: list[Operation] = []
        self._global_minibatch: int | None = None
        self._committed = False
        self._engines: list[ProgressEngine] = []
        self._activation_comms: dict[int, Communicator] = {}
        self.buckets: list[_Bucket] = []

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
        op = Operation(self, len(self._operations), name, distribution, parameter_sets,
                       inputs, outputs)
        if self._operations:
            op.prev, self._operations[-1].next = self._operations[-1], op
        self._operations.append(op)
        return op

    def activation_comm(self, distribution: Distribution) -> Communicator:
        """The communicator activations of ``distribution``'s operations use."""
        return self._activation_comms.get(id(distribution),
                                          distribution.communicator(GroupType.MODEL))

    def commit(self) -> None:
        """Build the communication plan once: buckets, lanes, buffers and the engines.

        Every rank must call it after registering the same operations in the same order.
        """
        if self._committed:
            raise RuntimeError("the session is already committed")
        self.env.require_alive()
        self._committed = True
        if self.phase is not Phase.TRAIN:
            return
        by_dist: dict[int, list[ParameterSet]] = {}
        dists: dict[int, Distribution] = {}
        for op in self._operations:
            for ps in op.parameter_sets:
                by_dist.setdefault(id(op.distribution), []).append(ps)
                dists[id(op.distribution)] = op.distribution
        for key, sets in by_dist.items():
            self._commit_distribution(dists[key], sets)

    def _commit_distribution(self, dist: Distribution, sets: list[ParameterSet]) -> None:
        config = self.scheduler
        codecs = [_codec_of(ps) for ps in sets]
        items = [PlanItem(key=k, numel=ps.local_count, dtype=str(ps.spec.dtype).removeprefix("torch."),
                          elem_bytes=ps.spec.dtype.itemsize,
                          position=ps.operation.index * 1000 + ps.index,
                          fusible=not ps.spec.distributed_update,
                          codec="" if codec is None else repr(codec))
                 for k, (ps, codec) in enumerate(zip(sets, codecs))]
        plans = build_plan(items, config)
        lanes = [dist.duplicate(GroupType.DATA, f"data-lane{i}") for i in range(config.lanes)]
        increments = dist.duplicate(GroupType.DATA, "data-increments")
        lengths = [0] * config.lanes
        buckets = []
        for plan in plans:
            bucket = _Bucket(plan, [sets[k] for k in plan.keys], codecs[plan.keys[0]], lanes,
                             increments, self.statistics, self.env.rank, self.env.timeout)
            bucket.job.order = lengths[plan.lane]
            lengths[plan.lane] += 1
            for ps in bucket.members:
                ps._bucket = bucket
            buckets.append(bucket)
        engine = ProgressEngine(lanes, [max(n, 1) for n in lengths], make_policy(config),
                                self.env.timeout)
        for bucket in buckets:
            bucket.engine = engine
        self._engines.append(engine)
        self.buckets.extend(buckets)

    def compression_state_dict(self) -> dict[str, Any]:
        """Every compressed bucket's codec state (error-feedback residuals, ...), by bucket
        name (its parameter sets' names joined with ``+``)."""
        return {bucket.job.name: bucket.compressor.state_dict()
                for bucket in self.buckets if bucket.compressor is not None}

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`compression_state_dict` returned.

        Raises:
            ValueError: the state names parameter sets this session does not compress.
        """
        compressed = {b.job.name: b for b in self.buckets if b.compressor is not None}
        unknown = sorted(set(state) - set(compressed))
        if unknown:
            raise ValueError(f"compression state for buckets this session does not have: "
                             f"{unknown}; it has {sorted(compressed)}")
        for name, entry in state.items():
            compressed[name].compressor.load_state_dict(entry)

    def measure_isolation(self, repeats: int = 3) -> None:
        """Time each bucket's collective alone (every rank must call); adds isolation time."""
        for bucket in self.buckets:
            if bucket.data_size == 1:
                continue
            comm = bucket.increment_comm
            best = float("inf")
            for _ in range(repeats):
                collectives.barrier(comm)
                began = time.perf_counter()
                collectives.allreduce(comm, bucket.buffer.clone()).wait()
                best = min(best, time.perf_counter() - began)
            for ps in bucket.members:
                self.statistics.add(ps.operation.name, isolation_s=best / len(bucket.members))

    def close(self) -> None:
        """Stop the progress engines."""
        for engine in self._engines:
            engine.close()
        self._engines.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
