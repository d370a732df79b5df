"""The scheduling policies and the progress engine, pinned without any communication.

Fake chunks record the order the engine starts them in and complete when the test says, so
the tests see exactly which chunk goes first under FIFO, under priority with pre-emption,
and how many bytes a credit lets into flight.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from scaleout.core.errors import CommunicationTimeout
from scaleout.core.request import Deadline, Request
from scaleout.scheduler import FifoPolicy, Job, LaneState, PriorityPolicy, ProgressEngine

KB = 1024


def lane(queued: int = 0, next_bytes: int = 0, inflight: int = 0, inflight_bytes: int = 0,
         blocked: bool = False) -> LaneState:
    return LaneState(queued=queued, next_bytes=next_bytes, inflight=inflight,
                     inflight_bytes=inflight_bytes, blocked=blocked)


# -- policies ----------------------------------------------------------------------------

def test_fifo_sends_whatever_is_queued_on_its_one_lane() -> None:
    policy = FifoPolicy()
    assert policy.choose([lane(queued=1, next_bytes=KB)]) == 0
    assert policy.choose([lane(queued=1, inflight=5, inflight_bytes=100 * KB)]) == 0
    assert policy.choose([lane()]) is None
    assert policy.choose([lane(queued=1, blocked=True)]) is None  # a multi-round exchange


def test_priority_urgent_lane_always_first() -> None:
    policy = PriorityPolicy(credit_bytes=4 * KB)
    assert policy.choose([lane(queued=1, next_bytes=KB), lane(queued=3, next_bytes=KB)]) == 0
    # urgent data in flight or queued: the bulk lane waits (pre-emption at chunk boundaries)
    assert policy.choose([lane(inflight=1, inflight_bytes=KB), lane(queued=3, next_bytes=KB)]) is None
    assert policy.choose([lane(), lane(queued=3, next_bytes=KB)]) == 1


def test_priority_bulk_lane_keeps_within_its_credit() -> None:
    policy = PriorityPolicy(credit_bytes=4 * KB)
    assert policy.choose([lane(), lane(queued=2, next_bytes=2 * KB, inflight=1,
                                       inflight_bytes=2 * KB)]) == 1  # 4 KB: at the credit
    assert policy.choose([lane(), lane(queued=2, next_bytes=2 * KB, inflight=2,
                                       inflight_bytes=3 * KB)]) is None  # 5 KB: over it
    # one chunk may always be in flight, however large
    assert policy.choose([lane(), lane(queued=1, next_bytes=64 * KB)]) == 1



def test_priority_bulk_lane_keeps_one_chunk_per_channel_in_flight() -> None:
    policy = PriorityPolicy(credit_bytes=4 * KB, channels=2)
    big = dict(queued=2, next_bytes=8 * KB)
    assert policy.choose([lane(), lane(**big, inflight=1, inflight_bytes=8 * KB)]) == 1
    assert policy.choose([lane(), lane(**big, inflight=2, inflight_bytes=16 * KB)]) is None
    # the urgent lane still pre-empts
    assert policy.choose([lane(queued=1, next_bytes=KB), lane(**big, inflight=1)]) == 0


def test_channels_are_checked() -> None:
    from scaleout import SchedulerConfig

    assert SchedulerConfig(channels=3).channels == 3 and SchedulerConfig().channels is None
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="channels"):
            SchedulerConfig(channels=bad)

# -- the engine ----------------------------------------------------------------------------

class FakeRequest(Request):
    """A chunk in flight that completes when the test calls :meth:`complete`."""

    def __init__(self, name: str) -> None:
        super().__init__(rank=0, group="fake", operation=name, timeout=5.0)
        self._event = threading.Event()
        self._callbacks: list[Callable[[Request], None]] = []
        self._lock = threading.Lock()

    def complete(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _wait(self, deadline: Deadline) -> None:
        if not self._event.wait(deadline.remaining()):
            raise self.timed_out(deadline)

    def test(self) -> bool:
        return self._event.is_set()

    def when_done(self, callback: Callable[[Request], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)


@dataclass
class FakeComm:
    global_rank: int = 0
    label: str = "fake[0]"


class Recorder:
    """Chunk starts that log their name and hand back a FakeRequest."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.requests: dict[str, FakeRequest] = {}
        self._lock = threading.Lock()

    def chunk(self, name: str, nbytes: int) -> tuple[int, Callable[[object], Request]]:
        def start(_comm: object) -> Request:
            request = FakeRequest(name)
            with self._lock:
                self.started.append(name)
                self.requests[name] = request
            return request
        return nbytes, start

    def job(self, name: str, lane: int, order: int, chunks: int, nbytes: int) -> Job:
        return Job(name=name, lane=lane, order=order, finish=lambda: None,
                   chunks=[self.chunk(f"{name}.{i}", nbytes) for i in range(chunks)])

    def wait_started(self, count: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.started) >= count:
                    return list(self.started)
            time.sleep(0.005)
        raise AssertionError(f"only {self.started} started, expected {count}")

    def settle(self) -> list[str]:
        time.sleep(0.1)  # nothing more may start
        with self._lock:
            return list(self.started)

    def complete(self, name: str) -> None:
        self.requests[name].complete()


def test_fifo_engine_sends_jobs_in_lane_order_whatever_order_they_become_ready() -> None:
    rec = Recorder()
    engine = ProgressEngine([FakeComm()], [3], FifoPolicy(), timeout=5.0)
    jobs = [rec.job(f"b{i}", lane=0, order=i, chunks=1, nbytes=KB) for i in range(3)]
    engine.submit(jobs[2])
    engine.submit(jobs[1])
    assert rec.settle() == []  # b0 is not ready: nothing may overtake it
    engine.submit(jobs[0])
    assert rec.wait_started(3) == ["b0.0", "b1.0", "b2.0"]
    for name in ["b0.0", "b1.0", "b2.0"]:
        rec.complete(name)
    for job in jobs:
        job.wait(5.0)
    engine.close()


def test_engine_sends_a_jobs_released_chunks_before_the_rest_is_filled() -> None:
    rec = Recorder()
    engine = ProgressEngine([FakeComm()], [2], FifoPolicy(), timeout=5.0)
    big = rec.job("big", lane=0, order=0, chunks=3, nbytes=KB)
    after = rec.job("after", lane=0, order=1, chunks=1, nbytes=KB)
    engine.submit(big, 1)
    assert rec.wait_started(1) == ["big.0"]  # its first chunk goes at once
    engine.submit(after)  # ready, but the lane's order holds it behind all of big
    rec.complete("big.0")
    assert rec.settle() == ["big.0"]
    assert not big.test()
    engine.release(big, 3)
    assert rec.wait_started(4) == ["big.0", "big.1", "big.2", "after.0"]
    for name in ["big.1", "big.2", "after.0"]:
        rec.complete(name)
    big.wait(5.0)
    after.wait(5.0)
    engine.close()


def test_priority_engine_urgent_chunk_preempts_a_big_bulk_bucket() -> None:
    rec = Recorder()
    engine = ProgressEngine([FakeComm(), FakeComm()], [1, 1], PriorityPolicy(credit_bytes=2 * KB),
                            timeout=5.0)
    bulk = rec.job("bulk", lane=1, order=0, chunks=4, nbytes=2 * KB)
    urgent = rec.job("urgent", lane=0, order=0, chunks=1, nbytes=KB)
    engine.submit(bulk)
    assert rec.wait_started(1) == ["bulk.0"]
    assert rec.settle() == ["bulk.0"]  # the credit (one 2 KB chunk) holds the rest back
    engine.submit(urgent)
    assert rec.wait_started(2) == ["bulk.0", "urgent.0"]  # urgent goes at once
    rec.complete("bulk.0")
    assert rec.settle() == ["bulk.0", "urgent.0"]  # bulk waits while urgent is in flight
    rec.complete("urgent.0")
    urgent.wait(5.0)
    assert rec.wait_started(3)[-1] == "bulk.1"
    for i in range(1, 4):
        rec.wait_started(2 + i)
        rec.complete(f"bulk.{i}")
    bulk.wait(5.0)
    engine.close()


def test_priority_engine_credit_bounds_bytes_in_flight() -> None:
    rec = Recorder()
    engine = ProgressEngine([FakeComm(), FakeComm()], [1, 1], PriorityPolicy(credit_bytes=3 * KB),
                            timeout=5.0)
    bulk = rec.job("bulk", lane=1, order=0, chunks=6, nbytes=KB)
    engine.submit(bulk)
    assert rec.wait_started(3) == ["bulk.0", "bulk.1", "bulk.2"]
    assert len(rec.settle()) == 3  # 3 KB in flight: the credit is full
    rec.complete("bulk.0")
    assert rec.wait_started(4)[-1] == "bulk.3"
    assert len(rec.settle()) == 4
    for i in range(1, 6):
        rec.wait_started(min(i + 3, 6))
        rec.complete(f"bulk.{i}")
    bulk.wait(5.0)
    engine.close()


def test_engine_fails_a_job_whose_chunk_outlives_the_timeout() -> None:
    rec = Recorder()
    engine = ProgressEngine([FakeComm()], [1], FifoPolicy(), timeout=0.3)
    job = rec.job("stuck", lane=0, order=0, chunks=1, nbytes=KB)
    engine.submit(job)
    with pytest.raises(CommunicationTimeout, match="gradient communication of stuck"):
        job.wait(5.0)
    engine.close()


def test_open_choices_are_resolved_for_the_buffers() -> None:
    """Policy and channels left open: fifo on two channels for CUDA tensors over gloo (no
    chunks, so nothing to pre-empt); fifo for ranks all on one machine; elsewhere one
    channel, and the policy left to the plan (``plan_and_policy``, tests/test_plan.py);
    explicit choices stay."""
    from scaleout import SchedulerConfig

    gloo_cuda = SchedulerConfig().resolved(cuda_over_gloo=True)
    assert (gloo_cuda.policy, gloo_cuda.channels, gloo_cuda.lanes) == ("fifo", 2, 1)
    other = SchedulerConfig().resolved(cuda_over_gloo=False)
    assert (other.policy, other.channels) == (None, 1)
    # every rank on one machine: no link to share, so nothing worth pre-empting
    local = SchedulerConfig().resolved(cuda_over_gloo=False, one_machine=True)
    assert (local.policy, local.channels, local.lanes) == ("fifo", 1, 1)
    assert SchedulerConfig(policy="priority").resolved(cuda_over_gloo=False,
                                                       one_machine=True).policy == "priority"
    kept = SchedulerConfig(policy="priority", channels=3).resolved(cuda_over_gloo=True)
    assert (kept.policy, kept.channels) == ("priority", 3)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread count is one")
def test_engine_thread_computes_with_the_ranks_intra_op_thread_count() -> None:
    """A codec's matrix products on the engine's thread use ``torch.set_num_threads``'s count
    (a new thread's BLAS would otherwise use one thread per core): the process's CPU time
    over them stays close to their wall time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(800, 800)
    seen: dict[str, float] = {}

    def start(_comm: object) -> Request:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(8):
            a @ a
        seen["cpu/wall"] = (time.process_time() - c0) / (time.perf_counter() - t0)
        request = FakeRequest("matmul")
        request.complete()
        return request

    engine = ProgressEngine([FakeComm()], [1], FifoPolicy(), timeout=5.0)
    try:
        job = Job(name="matmul", lane=0, order=0, finish=lambda: None, chunks=[(KB, start)])
        engine.submit(job)
        job.wait(60.0)
    finally:
        engine.close()
        torch.set_num_threads(previous)
    assert seen["cpu/wall"] < 1.3, seen
