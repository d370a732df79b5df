"""Stopwatches for Statistics: host time on the CPU, CUDA events on a GPU.

On a GPU the host runs ahead of the kernels, so the host clock measures how long it took to
*launch* work. :class:`CudaStopwatch` records events on the current stream instead and reads
their elapsed times only once the events have completed (a later ``flush``), so timing never
synchronises the host with the device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from scaleout.session.statistics import Statistics

__all__ = ["Stopwatch", "CudaStopwatch", "stopwatch_for"]

#: One operation, or several with their shares of the time (a bucket's members, by size).
Operations = str | Sequence[tuple[str, float]]


def _trace(statistics: Statistics, operations: Operations, phase: str, start: float,
           end: float) -> None:
    if phase and statistics.trace is not None and isinstance(operations, str):
        statistics.trace.span("compute", operations, start, end, phase=phase)


def _add(statistics: Statistics, operations: Operations, field: str, seconds: float,
         phase: str = "") -> None:
    """Add ``seconds`` to ``field`` (and compute in backward to ``backward_s`` as well)."""
    shares = ((operations, 1.0),) if isinstance(operations, str) else operations
    if field == "compute_s" and phase == "backward":
        statistics.add_shared(shares, compute_s=seconds, backward_s=seconds)
    else:
        statistics.add_shared(shares, **{field: seconds})


class Stopwatch:
    """Seconds between laps on the host clock; each lap is added to an operation at once.

    A plain object (``__slots__``), because hooks lap it hundreds of times per iteration.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, statistics: Statistics, operation: Operations, field: str = "compute_s",
            phase: str = "") -> None:
        """Add the seconds since the previous lap or restart to ``operation``'s ``field``
        (and, with a ``phase`` and a trace, log the span as compute of that phase)."""
        now = time.perf_counter()
        _add(statistics, operation, field, now - self._last, phase)
        _trace(statistics, operation, phase, self._last, now)
        self._last = now

    def begin(self) -> None:
        """Nothing to look up on the host."""

    def flush(self, statistics: Statistics) -> None:
        """Nothing is deferred on the host."""


class CudaStopwatch:
    """Laps timed by CUDA events, added once the events completed.

    One event per lap: a lap ends where the next begins, so its end event is the next
    lap's start. Events are recycled once no pending lap needs them. The stream is looked
    up once per iteration (:meth:`begin`), not at every lap.

    Args:
        device: the GPU whose current stream is timed.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.current_stream(device)
        self._free: list[Any] = []
        self._uses: dict[int, int] = {}  # id(event) -> pending laps that use it
        self._pending: deque[tuple[Operations, str, str, Any, Any]] = deque()
        self._last = self._event()
        self._host = time.perf_counter()  # for traces: when the work was issued

    def begin(self) -> None:
        """Time on the stream that is current now (call once per iteration)."""
        self._stream = torch.cuda.current_stream(self._device)

    def _event(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def _release(self, event: Any) -> None:
        if not self._uses.get(id(event)) and event is not self._last:
            self._uses.pop(id(event), None)
            self._free.append(event)

    def restart(self) -> None:
        previous, self._last = self._last, self._event()
        self._release(previous)
        self._host = time.perf_counter()

    def lap(self, statistics: Statistics, operation: Operations, field: str = "compute_s",
            phase: str = "") -> None:
        start, end = self._last, self._event()
        self._pending.append((operation, field, phase, start, end))
        for event in (start, end):
            self._uses[id(event)] = self._uses.get(id(event), 0) + 1
        self._last = end
        host = time.perf_counter()
        _trace(statistics, operation, phase, self._host, host)
        self._host = host

    def flush(self, statistics: Statistics) -> None:
        """Add every lap whose end event has completed, in order (never blocks)."""
        while self._pending and self._pending[0][4].query():
            operation, field, phase, start, end = self._pending.popleft()
            _add(statistics, operation, field, start.elapsed_time(end) / 1e3, phase)
            for event in (start, end):
                self._uses[id(event)] -= 1
                self._release(event)


def stopwatch_for(device: torch.device) -> Stopwatch | CudaStopwatch:
    """A CUDA-event stopwatch for a GPU, the host clock otherwise."""
    return CudaStopwatch(device) if device.type == "cuda" else Stopwatch()
