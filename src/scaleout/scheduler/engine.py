"""The progress engine: a dedicated thread that owns a session's outstanding communication.

MLSL drove non-blocking MPI from endpoint-server processes; here one thread per session
takes buckets whose gradients are ready, cuts them into chunks, and sends them through
torch.distributed in each lane's fixed order at the moments the policy allows. Completion
callbacks from the communication library come back through the same inbox, so the engine's
state is touched by its thread alone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from scaleout.core import progress, stalls
from scaleout.core.collectives import Communicator
from scaleout.core.errors import CommunicationError
from scaleout.core.request import Deadline, Request
from scaleout.core.peer_waits import wait_event
from scaleout.scheduler.policy import LaneState, Policy

__all__ = ["Job", "ProgressEngine"]

_IDLE_POLL = 0.5  # seconds the idle thread waits for news before it looks at the timeouts

# One piece of a job: starts its collective on the lane's communicator without blocking and
# returns a request with test(), wait() and when_done() (a Request or a CompressedRequest).
ChunkStart = Callable[[Communicator], Request]


class Job(Request):
    """One bucket's communication in one iteration, as the engine runs it (a Request: its
    owner waits on it like on any collective).

    Args:
        name: for errors and statistics.
        lane: which lane (communicator) carries it.
        order: its place in the lane's fixed issue sequence.
        chunks: (bytes, start) per chunk, sent in order.
        finish: runs on the engine thread once every chunk completed.
        exclusive: its requests may take several rounds; while one is in flight nothing
            else is sent on the lane, so every rank's sequence of collectives stays the same.
        rank, timeout: for errors, and the default wait.
        group: the label of the communicator its chunks run on (default ``lane <lane>``):
            a timed-out wait names the ranks that have not reached that communicator's
            call (before stop 49 the lane's number named none of them).
    """

    def __init__(self, *, name: str, lane: int, order: int,
                 chunks: Sequence[tuple[int, ChunkStart]], finish: Callable[[], None],
                 exclusive: bool = False, rank: int = 0, timeout: float = 300.0,
                 group: str | None = None) -> None:
        super().__init__(rank=rank, group=group or f"lane {lane}",
                         operation=f"gradient communication of {name}", timeout=timeout)
        self.name = name
        self.lane = lane
        self.order = order
        self.chunks = list(chunks)
        self.finish = finish
        self.exclusive = exclusive
        self.finished = threading.Event()
        self.failure: BaseException | None = None
        self.ready_at = self.issued_at = self.completed_at = 0.0
        self.remaining = 0
        # the engine thread's: chunks the owner declared filled, and those queued on the lane
        self.released = self.queued = 0
        self._callbacks: list[Callable[[Request], None]] = []

    @property
    def chunk_bytes(self) -> list[int]:
        return [nbytes for nbytes, _ in self.chunks]

    def reset(self) -> None:
        """Ready for this iteration's run (the engine calls it on submit)."""
        self.finished.clear()
        self.failure = None
        self._done = False
        self.ready_at = time.perf_counter()
        self.remaining = len(self.chunks)
        self.released = self.queued = 0

    def complete(self, error: BaseException | None = None) -> None:
        """Mark it finished (engine thread); waiters wake up."""
        self.failure = self.failure or error
        self.completed_at = time.perf_counter()
        self.finished.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _wait(self, deadline: Deadline) -> None:
        # in slices: a peer's failure seen by the watchdog ends the wait at once
        if not wait_event(self.finished, deadline.remaining(), self.rank, self.group,
                          self.operation):
            raise self.timed_out(deadline)
        if self.failure is not None:
            raise self.failure

    def test(self) -> bool:
        return self.finished.is_set()

    def when_done(self, callback: Callable[[Request], None]) -> None:
        if self.finished.is_set():
            callback(self)
        else:
            self._callbacks.append(callback)


class _Lane:
    def __init__(self, comm: Communicator, length: int) -> None:
        self.comm = comm
        self.length = length  # jobs per iteration in this lane
        self.next_order = 0
        self.ready: dict[int, Job] = {}
        self.queue: deque[tuple[Job, int, ChunkStart]] = deque()
        self.inflight: dict[int, tuple[Job, int, Deadline]] = {}  # id -> (job, bytes, deadline)

    def state(self) -> LaneState:
        return LaneState(queued=len(self.queue),
                         next_bytes=self.queue[0][1] if self.queue else 0,
                         inflight=len(self.inflight),
                         inflight_bytes=sum(b for _, b, _ in self.inflight.values()),
                         blocked=any(job.exclusive for job, _, _ in self.inflight.values()))


class ProgressEngine:
    """Runs jobs on their lanes' communicators under a policy, on its own thread.

    Args:
        comms: one communicator per lane (separate process groups, so that a lane's
            collectives never queue behind another lane's inside the library).
        lane_lengths: how many jobs each lane carries per iteration (its fixed sequence).
        policy: decides when each lane may send its next chunk.
        timeout: seconds a chunk may be in flight before its job fails.
        stream: a CUDA stream (for buffers on a GPU): the engine thread's current stream,
            so every collective, codec kernel and averaging it launches runs there, apart
            from the compute stream; ``None`` on the CPU.
    """

    def __init__(self, comms: Sequence[Communicator], lane_lengths: Sequence[int],
                 policy: Policy, timeout: float, stream: Any = None) -> None:
        self._lanes = [_Lane(c, n) for c, n in zip(comms, lane_lengths)]
        self._policy = policy
        self._timeout = timeout
        self._rank = comms[0].global_rank
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._stream = stream
        self._threads = torch.get_num_threads()  # the creating thread's (see _run)
        self._thread = threading.Thread(target=self._run, name="scaleout-progress", daemon=True)
        self._thread.start()
        progress.register_busy(self.busy)

    def busy(self) -> bool:
        """Whether this engine may still start a collective: its thread runs and holds work
        (news not read yet, chunks queued, jobs waiting their turn or in flight). Read from
        the watchdog's thread for its heartbeat (single reads of the engine thread's
        containers: a snapshot, not a lock)."""
        return self._thread.is_alive() and (not self._inbox.empty() or any(
            lane.queue or lane.inflight or lane.ready for lane in self._lanes))

    def submit(self, job: Job, ready: int | None = None) -> None:
        """Hand over this iteration's run of ``job``, whose first ``ready`` chunks (all:
        ``None``) have their buffers filled; :meth:`release` hands over more of them. The
        engine sends a lane's jobs in its fixed order, each job's chunks in order: a job's
        released chunks may go while its later ones are being filled, and the lane's next
        job follows its last one."""
        self._check_open("submit")
        job.reset()
        self._inbox.put(("ready", (job, len(job.chunks) if ready is None else ready)))

    def release(self, job: Job, ready: int) -> None:
        """The first ``ready`` chunks of a submitted job have their buffers filled."""
        self._check_open("release")
        self._inbox.put(("ready", (job, ready)))

    def _check_open(self, operation: str) -> None:
        if self._failure is not None:
            raise CommunicationError(
                f"rank {self._rank}: the progress engine stopped: {self._failure}",
                rank=self._rank, group="engine", operation=operation) from self._failure
        if not self._thread.is_alive():
            raise CommunicationError(f"rank {self._rank}: the progress engine is closed",
                                     rank=self._rank, group="engine", operation=operation)

    def close(self) -> None:
        """Stop the thread (jobs in flight are abandoned)."""
        self._inbox.put(("stop", None))
        if threading.current_thread() is not self._thread:  # (a model collected there)
            self._thread.join(timeout=5.0)

    # -- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        # The rank's intra-op thread count. A new thread's OpenMP and MKL take theirs from
        # OMP_NUM_THREADS (else one per core), not from ``torch.set_num_threads``: without
        # this, BLAS on this thread (PowerSGD's matrix products) ran on 2 threads per rank
        # on a 2-core machine where the rank asked for 1, or on 1 under torchrun's
        # OMP_NUM_THREADS=1 where the rank asked for more.
        torch.set_num_threads(self._threads)
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # this thread's current stream
        try:
            while True:
                due = time.monotonic() + _IDLE_POLL
                try:
                    kind, payload = self._inbox.get(timeout=_IDLE_POLL)
                except queue.Empty:
                    stalls.note_late(due)  # (this process was stopped: see core/stalls.py)
                    self._check_timeouts()
                    continue
                stalls.note_late(due)
                if kind == "stop":
                    return
                self._handle(kind, payload)
                while True:  # drain what else arrived, then decide what to send
                    try:
                        kind, payload = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "stop":
                        return
                    self._handle(kind, payload)
                self._issue()
                self._check_timeouts()
        except BaseException as err:  # noqa: BLE001 - reported to every waiter
            self._failure = err
            self._fail_all(err)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "ready":
            job, released = payload
            job.released = max(job.released, released)
            lane = self._lanes[job.lane]
            lane.ready[job.order] = job
            while lane.next_order in lane.ready:  # fixed order within the lane
                head = lane.ready[lane.next_order]
                for nbytes, start in head.chunks[head.queued:head.released]:
                    lane.queue.append((head, nbytes, start))
                head.queued = head.released
                if not head.chunks:
                    self._complete(head)
                elif head.queued < len(head.chunks):  # the rest is being filled
                    return
                del lane.ready[lane.next_order]
                lane.next_order = (lane.next_order + 1) % lane.length
        elif kind == "done":
            lane_index, request = payload
            lane = self._lanes[lane_index]
            job = lane.inflight[id(request)][0]
            try:
                if not request.test():  # a multi-round exchange started its next round
                    self._watch(lane_index, request)
                    return
                request.wait(timeout=self._timeout)
            except BaseException as err:  # noqa: BLE001
                job.failure = job.failure or err
            del lane.inflight[id(request)]
            job.remaining -= 1
            if job.remaining == 0:
                self._complete(job)

    def _complete(self, job: Job) -> None:
        error = None
        if job.failure is None:
            try:
                job.finish()
            except BaseException as err:  # noqa: BLE001
                error = err
        job.complete(error)

    def _issue(self) -> None:
        while True:
            choice = self._policy.choose([lane.state() for lane in self._lanes])
            if choice is None:
                return
            lane = self._lanes[choice]
            job, nbytes, start = lane.queue.popleft()
            if job.issued_at < job.ready_at:
                job.issued_at = time.perf_counter()
            try:
                request = start(lane.comm)
            except Exception as err:  # noqa: BLE001 - a hook's error: its job's waiters raise it
                lane.queue = deque(item for item in lane.queue if item[0] is not job)
                job.complete(err)
                continue
            lane.inflight[id(request)] = (job, nbytes, Deadline(self._timeout))
            self._watch(choice, request)

    def _watch(self, lane: int, request: Any) -> None:
        """Have ``request``'s completion (of its current round) come back through the inbox.

        A chunk's start never blocks: multi-round exchanges (some codecs) advance one round
        per completion, on this thread, so no lane can hold the engine while a peer waits.
        """
        request.when_done(lambda r: self._inbox.put(("done", (lane, r))))

    def _check_timeouts(self) -> None:
        for lane in self._lanes:
            for request, (job, _, deadline) in list(lane.inflight.items()):
                if deadline.expired() and not job.finished.is_set():
                    job.complete(job.timed_out(deadline))

    def _fail_all(self, err: BaseException) -> None:
        for lane in self._lanes:
            jobs = {id(j): j for j, _, _ in lane.queue}
            jobs.update({id(j): j for j, _, _ in lane.inflight.values()})
            jobs.update({id(j): j for j in lane.ready.values()})
            for job in jobs.values():
                job.complete(err)
