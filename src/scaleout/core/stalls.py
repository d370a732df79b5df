"""Spans in which this whole process did not run: stopped (SIGSTOP, as Slurm's ``scontrol
suspend`` and gang scheduling do it, or a debugger) or starved of every core.

A collective under way cannot outlive such a span longer than its timeout: gloo's own receive
times out at the resume (as it does under plain ``torch.distributed``), and so do scaleout's
waits. What scaleout can do is say so. The threads that look at the clock regularly note a
look that came much later than it should have (:func:`note_late`: the watchdog's rounds, the
waits' slices, the progress thread's idle polls), and a timed-out wait asks how much of its
time the process spent stopped (:func:`stopped_within`) to name the cause in its error rather
than blaming a peer.
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["LATE_S", "note_late", "stopped_within", "why_timed_out"]

#: a look this many seconds later than due means the process did not run in between (a
#: busy host delays a thread by milliseconds; a stop lasts for as long as it lasts)
LATE_S = 0.5

_lock = threading.Lock()
_spans: deque[tuple[float, float]] = deque(maxlen=32)  # (begin, end), time.monotonic()


def note_late(due: float, now: float | None = None) -> float:
    """A thread that meant to look at ``due`` (``time.monotonic()``) looks at ``now``: if it
    is more than :data:`LATE_S` late, note the span ``due..now`` as stopped. Several threads
    may note the same stop; :func:`stopped_within` counts it once.

    Returns:
        the seconds it was late (0.0 when within :data:`LATE_S`).
    """
    now = time.monotonic() if now is None else now
    late = now - due
    if late <= LATE_S:
        return 0.0
    with _lock:
        _spans.append((due, now))
    return late


def stopped_within(begin: float, end: float) -> float:
    """Seconds between ``begin`` and ``end`` (``time.monotonic()``) that fall in a noted span
    (their union: overlapping notes of one stop count once)."""
    with _lock:
        spans = sorted((max(b, begin), min(e, end)) for b, e in _spans if e > begin and b < end)
    total, reach = 0.0, begin
    for b, e in spans:
        if e > reach:
            total += e - max(b, reach)
            reach = e
    return total


def why_timed_out(began: float, seconds: float) -> str | None:
    """For a wait of ``seconds`` that began at ``began`` and timed out now: the sentence that
    names a stop of this process as the cause, when the process was stopped for a noticeable
    part of it (at least a tenth, and at least :data:`LATE_S`), else None."""
    stopped = stopped_within(began, time.monotonic())
    if stopped < max(LATE_S, 0.1 * seconds):
        return None
    return (f"this process did not run for {stopped:.1f} s of that time: it was stopped (a job "
            "suspension, a debugger) or starved; a collective under way fails when such a stop "
            "outlasts the timeout, as in torch.distributed: set scaleout.init(timeout=...) "
            "above the longest suspension")
