"""GradBucket: parameter sets' gradients fused into one flat buffer, and how it is sent.

A bucket owns its buffer, its chunking (from the plan), where its result is averaged
(:meth:`GradBucket.averaged`; for an exact sum, already on the way in: :meth:`GradBucket.fill`)
and its statistics. What its communication *is* —
exact allreduce, the sharded update's reduce-scatter, a codec's exchange, a user's DDP comm
hook — is a hook ``hook(state, bucket) -> Request | torch.futures.Future`` whose result is
the bucket's gradient averaged over the data group (DDP's comm-hook contract; the methods
DDP's ``GradBucket`` offers are here too, so torch's own hooks run unchanged).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.request import FutureRequest, Request
from scaleout.scheduler import Job, ProgressEngine, SchedulerConfig, chunk_needs, chunks_ready
from scaleout.session.statistics import Statistics
from scaleout.session.timing import stopwatch_for

if TYPE_CHECKING:
    from scaleout.session.parameter_set import ParameterSet

__all__ = ["GradBucket", "CommHook", "cuda_over_gloo"]

#: ``hook(state, bucket)`` starts the bucket's communication; its result is the averaged
#: flat gradient (or, with the sharded update, this rank's averaged owned slice).
CommHook = Callable[[Any, "GradBucket"], Any]


class GradBucket:
    """One bucket of a committed session.

    Args:
        index: its place in the issue order (0 = first ready in backward).
        name: its members' names joined by ``+`` (statistics, errors, checkpoints).
        members: the parameter sets, in buffer order, with their element offsets.
        numel: buffer elements (padded to a multiple of the group for the sharded update).
        dtype, device: of the buffer (the gradients').
        comm: the lane communicator it is sent on.
        hook, state: its communication.
        chunks: element ranges sent one by one when the hook works elementwise
            (``hook.elementwise``); otherwise the bucket goes whole.
        exclusive: its exchange may take several rounds (it then owns its lane).
        last: it is the last bucket of the iteration.
    """

    def __init__(self, *, index: int, lane: int, order: int, members: Sequence[ParameterSet],
                 offsets: Sequence[int], numel: int, dtype: torch.dtype, device: torch.device,
                 comm: Communicator, hook: CommHook, state: Any,
                 chunks: Sequence[tuple[int, int]], exclusive: bool, last: bool,
                 statistics: Statistics) -> None:
        self._index = index
        self.members = list(members)
        self.name = "+".join(ps.name for ps in members)
        self.comm = comm
        self.hook = hook
        self.state = state
        self.statistics = statistics
        self._buffer = torch.zeros(numel, dtype=dtype, device=device)
        # a hook that declares ``prescaled`` sums what fill() divided on the way in (DDP's
        # reducer does the same: the division rides on the copy, one pass over the gradients
        # fewer, and none on the progress thread, where every torch call waits for the GIL)
        self._divisor = comm.size if getattr(hook, "prescaled", False) else 1
        # each member's place in the buffer, flat and in its shape: fill() is one torch call
        self._slots = {id(ps): (self._buffer[off: off + ps.local_count],
                                self._buffer[off: off + ps.local_count].view(ps.shape))
                       for ps, off in zip(members, offsets)}
        self._offsets = {id(ps): off for ps, off in zip(members, offsets)}
        self._last = last
        self._params: list[torch.Tensor] = []
        # this iteration's filling: which members (by place in the buffer) are in, how many
        # lead the buffer unbroken, and how many chunks went to the engine
        in_buffer = sorted(range(len(members)), key=lambda i: offsets[i])
        self._place = {id(members[i]): n for n, i in enumerate(in_buffer)}
        self._restart_filling()
        self._pending: list[Request] = []
        # On a GPU: one event per member, recorded on the compute stream after its gradient
        # is copied in (the communication stream waits on them before the bucket is sent),
        # and one recorded on the communication stream once the averaged result is there
        # (the compute stream waits on it before the result is read).
        cuda = self._buffer.is_cuda and comm.size > 1  # (a group of one sends nothing)
        self._ready = {id(ps): torch.cuda.Event() for ps in members} if cuda else {}
        self._done_event = torch.cuda.Event() if cuda else None
        self.stream: Any = None  # the engine's communication stream, bound by the session
        self._clock = stopwatch_for(self._buffer.device)  # issue to result (comm time)
        total = sum(ps.local_count for ps in members)
        self._shares = [(ps.op_name, ps.local_count / total) for ps in members]
        # chunks only where they pay: for CUDA tensors over gloo every chunk would be a round
        # trip through host memory of its own (pre-emption then costs more than it saves)
        elementwise = (getattr(hook, "elementwise", False) and comm.size > 1
                       and not cuda_over_gloo(comm, self._buffer.device))
        spans = list(chunks) if elementwise else [(0, numel)]
        # chunk k may leave once the first needs[k] members (buffer order) are filled: the
        # front of a bucket travels while backward still produces its back
        self._needs = chunk_needs([offsets[i] for i in in_buffer], spans)
        # on a GPU, the members whose copies chunk k's stream waits for (those before it
        # were waited for by the chunks before it, earlier on the same stream)
        self._waits = [[self._ready[id(members[i])] for i in in_buffer[before:need]]
                       for before, need in zip((0, *self._needs), self._needs)
                       ] if self._ready else []
        self.job = Job(name=self.name, lane=lane, order=order,
                       chunks=[] if comm.size == 1 else
                       [((end - begin) * self._buffer.element_size(),
                         lambda _comm, k=k, b=begin, e=end: self._start(k, b, e))
                        for k, (begin, end) in enumerate(spans)],
                       finish=self._finish, exclusive=exclusive, rank=comm.global_rank,
                       timeout=comm.timeout, group=comm.label)
        self.engine: ProgressEngine | None = None

    # -- what DDP's GradBucket offers (torch comm hooks use these) ------------------------

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients (a view of the part being sent, for a chunk)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def span(self, member: ParameterSet) -> tuple[int, int]:
        """(first, end) element of ``member``'s gradient in the flat buffer."""
        first = self._offsets[id(member)]
        return first, first + member.local_count

    def gradients(self) -> list[torch.Tensor]:
        """Each member's gradient, a view of the buffer in its shape."""
        return [self._slots[id(ps)][1] for ps in self.members]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients it holds (when a front end registered them)."""
        return list(self._params)

    def set_parameters(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)

    def is_last(self) -> bool:
        return self._last

    @property
    def process_group(self) -> Any:
        """The torch process group it is sent on."""
        return self.comm.group

    # -- averaging ------------------------------------------------------------------------

    def averaged(self, summed: Request) -> Request:
        """``summed`` (a request whose result is the sum over the data group) divided by the
        group size, in place in the buffer; a ``prescaled`` hook's sum is the average already
        (only copied in). Every built-in hook averages through here or in its exchange."""
        if self._divisor > 1:  # fill() divided already (the chunk's result lands in place)
            return summed
        size = self.comm.size
        return summed.then(lambda result: collectives.average_into(
            self._buffer[: result.numel()], result, size))

    # -- the scaleout side ----------------------------------------------------------------

    def fill(self, ps: ParameterSet, gradient: torch.Tensor) -> None:
        """Copy ``ps``'s gradient (``local_count`` elements, any shape) in, divided by the
        group size for a ``prescaled`` hook; the chunks whose members are all in go to the
        engine (:func:`~scaleout.scheduler.chunk_needs`), the whole bucket when the last
        member arrives."""
        flat, shaped = self._slots[id(ps)]
        if gradient.requires_grad:  # (a backward with create_graph=True)
            gradient = gradient.detach()
        if gradient.device != flat.device:  # (a caller's tensor elsewhere: copied over)
            gradient = gradient.to(flat.device)
        if gradient.shape != shaped.shape:
            gradient, shaped = gradient.reshape(-1), flat
        if self._divisor > 1:
            torch.div(gradient, self._divisor, out=shaped)
        else:
            shaped.copy_(gradient)
        if self._ready:
            self._ready[id(ps)].record()  # on the stream that produced the gradient
        self._release(self._place[id(ps)])

    def _release(self, place: int) -> None:
        """Member ``place`` (in buffer order) is in: hand the engine the chunks that are now
        complete (the first ones submit this iteration's run of the job)."""
        filled, needs = self._filled, self._needs
        filled[place] = True
        while self._prefix < len(filled) and filled[self._prefix]:
            self._prefix += 1
        ready = chunks_ready(needs, self._prefix)
        if ready == self._released:
            return
        first, self._released = self._released == 0, ready
        if ready == len(needs):  # every member is in: the next fill is the next iteration's
            self._restart_filling()
        if self.comm.size == 1:  # nothing to send: done here, no trip to the engine
            if ready == len(needs):
                self.job.reset()
                self.job.complete()
            return
        assert self.engine is not None, "the session binds every bucket to an engine"
        try:
            if first:
                self.engine.submit(self.job, ready)
            else:
                self.engine.release(self.job, ready)
        except BaseException as err:
            # the members that started before this one would wait for a job that never
            # runs (or see the last iteration's result): their waits raise this instead
            if first:
                self.job.reset()
            self.job.complete(err)
            self._restart_filling()
            raise

    def _restart_filling(self) -> None:
        self._filled = [False] * len(self.members)
        self._prefix = self._released = 0

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until the engine finished the bucket; on a GPU the current stream
        then waits for the result's kernels (the host does not)."""
        self.job.wait(timeout)
        if self._done_event is not None:
            self._done_event.wait()  # the current (compute) stream waits, the host does not

    def result(self, ps: ParameterSet) -> torch.Tensor:
        """``ps``'s averaged gradient (its owned slice, with the sharded update)."""
        if ps.spec.distributed_update:
            return self._buffer[: ps.owned_valid]
        return self._slots[id(ps)][0]

    def _start(self, chunk: int, begin: int, end: int) -> Request:
        # (engine thread: its current stream is the communication stream)
        for event in self._waits[chunk] if self._waits else ():
            self.stream.wait_event(event)
        if begin == 0:
            self._clock.flush(self.statistics)  # earlier iterations' GPU times, if done
            self._clock.begin()  # (on the communication stream)
            self._clock.restart()
        view = self
        if (begin, end) != (0, self._buffer.numel()):
            view = copy.copy(self)
            view._buffer = self._buffer[begin:end]
        started = self.hook(self.state, view)
        if not isinstance(started, Request) and callable(getattr(started, "then", None)):
            # a torch future (DDP hooks return torch._C.Future, torch.futures.Future's base)
            started = FutureRequest(started, rank=self.comm.global_rank, group=self.comm.label,
                                    operation=f"comm hook of {self.name}",
                                    timeout=self.comm.timeout)
        elif not isinstance(started, Request):
            raise TypeError(f"the comm hook {getattr(self.hook, '__name__', self.hook)!r} "
                            f"returned {type(started).__name__} for bucket {self.name}; it "
                            "must return a torch.futures.Future or a scaleout Request")
        target = view._buffer
        # the averaged bucket, or this rank's owned block of it with the sharded update
        expected = target.numel() // (self.comm.size if self.members[0].spec.distributed_update
                                      else 1)
        request = started.then(lambda result: _into(target, result, expected, self.name))
        self._pending.append(request)
        return request

    def _finish(self) -> None:
        if self.comm.size == 1:
            return
        if self._done_event is not None:
            self._done_event.record(self.stream)
        self._clock.lap(self.statistics, self._shares, "comm_s")
        raw = sum(self.job.chunk_bytes)
        sent = sum(request.nbytes for request in self._pending) or raw
        self._pending.clear()
        if self.statistics.trace is not None:
            codec = getattr(getattr(self.state, "codec", None), "name", None)
            self.statistics.trace.span(
                "comm", self.name, self.job.issued_at or self.job.ready_at, time.perf_counter(),
                bytes=sent, raw_bytes=raw, priority_lane=self.job.lane,
                codec=codec or getattr(self.hook, "__name__", "hook"))
        self.statistics.add_shared(self._shares, bytes=sent, raw_bytes=raw)  # by size

    def __repr__(self) -> str:
        return f"<GradBucket {self._index} {self.name} numel={self._buffer.numel()}>"


def _into(target: torch.Tensor, result: Any, expected: int, name: str) -> torch.Tensor:
    """A hook's result (``expected`` values) copied into the bucket's buffer unless it
    already is (a prefix of) it."""
    if isinstance(result, (list, tuple)) and result:  # some DDP hooks' futures: a 1-list
        result = result[0]
    if not isinstance(result, torch.Tensor) or result.numel() != expected:
        got = (f"{result.numel()} values" if isinstance(result, torch.Tensor)
               else type(result).__name__)
        raise ValueError(f"the comm hook's result for bucket {name} has {got}, expected "
                         f"{expected} (the bucket's gradient, averaged)")
    if result.data_ptr() != target.data_ptr() or result.dtype != target.dtype:
        target[: result.numel()].copy_(result.reshape(-1))
    return target


def scheduler_as_run(config: SchedulerConfig, comm: Communicator, device: torch.device,
                     one_machine: bool) -> SchedulerConfig:
    """``config`` with what a session decides before it sees its plan (the channels, and an
    open policy for CUDA tensors over gloo and for CPU tensors of ranks all on one machine,
    whose traffic is then host memory copies: GPUs of one machine still share its links;
    :meth:`~scaleout.scheduler.SchedulerConfig.resolved`): the session plans under it, and
    the autotuner prices the defaults as it."""
    return config.resolved(cuda_over_gloo=cuda_over_gloo(comm, device),
                           one_machine=one_machine and device.type == "cpu")


def cuda_over_gloo(comm: Communicator, device: torch.device) -> bool:
    """Whether tensors on ``device`` travel over ``comm`` as CUDA tensors through gloo (every
    call a round trip through host memory): not on the CPU, nor on NCCL, nor alone."""
    if device.type != "cuda" or comm.group is None or comm.size == 1:
        return False
    return "nccl" not in str(tdist.get_backend(comm.group))
