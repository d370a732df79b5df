"""The event core: a heap of (time, priority, sequence) -> callback.

Ties in time are broken by ``priority`` (lower first), then by insertion order, so a run
is deterministic. Callbacks may schedule further events; nothing here knows about networks
or training.

Example:
    >>> q = EventQueue()
    >>> seen = []
    >>> q.schedule(2.0, lambda: seen.append("b"))
    >>> q.schedule(1.0, lambda: seen.append("a"))
    >>> q.run()
    2.0
    >>> seen
    ['a', 'b']
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["EventQueue"]


class EventQueue:
    """A discrete-event clock.

    Attributes:
        now: the time of the event being (or last) processed, seconds.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, time: float, callback: Callable[[], None], *, priority: int = 0) -> None:
        """Run ``callback`` at ``time``.

        Raises:
            ValueError: ``time`` is earlier than :attr:`now` (events cannot go back).
        """
        if time < self.now:
            raise ValueError(f"cannot schedule at t={time!r}, earlier than now={self.now!r}")
        heapq.heappush(self._heap, (time, priority, self._seq, callback))
        self._seq += 1

    def after(self, delay: float, callback: Callable[[], None], *, priority: int = 0) -> None:
        """Run ``callback`` ``delay`` seconds from now.

        Raises:
            ValueError: a negative delay.
        """
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay!r}")
        self.schedule(self.now + delay, callback, priority=priority)

    def run(self, until: float | None = None) -> float:
        """Process events in order until none is left (or the next is after ``until``).

        Returns:
            The time of the last processed event.
        """
        while self._heap:
            if until is not None and self._heap[0][0] > until:
                break
            time, _, _, callback = heapq.heappop(self._heap)
            self.now = time
            self.processed += 1
            callback()
        return self.now
