"""Waits that fail fast once the watchdog (:mod:`scaleout.core.watchdog`) knows of a failed
peer: they block in slices of ``_SLICE`` seconds and raise
:class:`~scaleout.core.errors.PeerFailedError` naming the *failing* rank between slices."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

from scaleout.core import progress, stalls, watchdog
from scaleout.core.diverged import FinalizeWatch
from scaleout.core.errors import PeerFailedError

__all__ = ["lagging", "raise_if_failed", "wait_event", "wait_work"]

_SLICE = 0.2  # seconds a wait blocks before it looks at the watchdog again


def raise_if_failed(rank: int, group: str, operation: str) -> None:
    """Raise PeerFailedError (naming the failed rank, this rank, group and operation) if the
    watchdog knows of a failed rank; for wait loops and ``Request.test()``."""
    found = watchdog.blocked()
    if found is not None:
        watchdog.active().settle()  # type: ignore[union-attr]  # (found: one runs)
        watchdog.note_raised()
        raise PeerFailedError(
            f"rank {rank}: {operation} on group {group} cannot complete: {found.describe()}",
            rank=rank, group=group, operation=operation, failed_rank=found.rank)


def wait_event(event: threading.Event, seconds: float, rank: int, group: str,
               operation: str) -> bool:
    """``event.wait(seconds)`` in slices, raising PeerFailedError once a peer has failed.

    Returns:
        True when the event was set, False on timeout (as ``Event.wait``).
    """
    deadline = time.monotonic() + seconds
    diverged = FinalizeWatch(rank, group, operation)
    while True:
        step = min(_SLICE, max(deadline - time.monotonic(), 0.0))
        due = time.monotonic() + step
        if event.wait(step):
            return True
        stalls.note_late(due)  # (a slice that ended far too late: this process was stopped)
        diverged.check()
        raise_if_failed(rank, group, operation)
        if time.monotonic() >= deadline:
            return False


def wait_work(work: Any, seconds: float, rank: int, group: str, operation: str) -> None:
    """``work.wait(timeout=seconds)``, in slices, raising at once when a peer has failed.

    Raises:
        PeerFailedError: the watchdog found a failed rank; names it, this rank, the group
            and the operation.
        RuntimeError: the wait timed out (as ``work.wait`` raises it) or the work failed.
    """
    deadline = time.monotonic() + seconds
    diverged = FinalizeWatch(rank, group, operation)
    while True:
        diverged.check()
        raise_if_failed(rank, group, operation)
        remaining = deadline - time.monotonic()
        dog = watchdog.active()
        step = max(min(remaining, _SLICE) if dog is not None else remaining, 1e-3)
        due = time.monotonic() + step
        try:
            work.wait(timeout=timedelta(seconds=step))
            return
        except RuntimeError as err:
            stalls.note_late(due)
            if "timed out" in str(err).lower() and remaining > _SLICE:
                continue
            if dog is not None and "timed out" not in str(err).lower():
                # a peer died or left: let the watchdogs name it (within their limit)
                _verdict(dog.limit + 2 * dog.period)
                if watchdog.failure() is not None:  # (blocked() recorded a departure as one)
                    continue
            raise


def _verdict(seconds: float) -> None:
    """Wait up to ``seconds`` for the watchdog to find a failed rank."""
    deadline = time.monotonic() + seconds
    while watchdog.blocked() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def lagging(group: str) -> str | None:
    """:func:`scaleout.core.progress.lagging` from the members' last heartbeats, for a wait
    that timed out; None also when no watchdog runs, a failure is known or the store does
    not answer."""
    dog = watchdog.active()
    if dog is None or dog.failure() is not None:
        return None
    try:
        store = dog.connection()

        def heartbeat(rank: int) -> dict[str, Any]:
            beat = store.get_if_present(f"hb/{rank}")
            return {} if beat is None else json.loads(beat)

        return progress.lagging(group, dog.rank, heartbeat)
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None  # (a store that does not answer, or a heartbeat of another format)
