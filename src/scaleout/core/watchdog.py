"""Failure detection apart from the collective timeout: heartbeats through the job's store.

Every rank runs a daemon thread that, every ``period`` seconds, bumps its heartbeat entry in
the (authenticated) store and watches its successor ``(rank + 1) % world``: a successor
whose heartbeat stops moving for ``limit`` seconds (frozen, SIGSTOP, a dead host), or whose
process is gone or stopped (seen at once in ``/proc`` when it shares this machine), has
failed; so has rank 0 when its store stops answering. The rank that notices writes the
failure to the store; every rank reads it within one period. Waits then fail fast:
:func:`wait_work` (used by :class:`~scaleout.core.request.Request`) waits in slices and raises
:class:`~scaleout.core.errors.PeerFailedError` naming the *failing* rank.

``SCALEOUT_HEARTBEAT`` sets ``limit`` (seconds, default 15; ``0`` turns the watchdog off).
A rank that calls ``finalize()`` marks itself as left first, so finishing is not failing.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from scaleout.core.checks import check_seconds
from scaleout.core.errors import PeerFailedError
from scaleout.launch.lifeline import REPORT_DIR_VAR, exit_of
from scaleout.launch.environment import machine

if TYPE_CHECKING:  # (a run-time import would make core and launch import each other)
    from scaleout.launch.rendezvous import Rendezvous

__all__ = ["HEARTBEAT_VAR", "DEFAULT_LIMIT", "PeerFailure", "Watchdog", "start", "stop",
           "failure", "raise_if_failed", "wait_event", "wait_work", "heartbeat_limit"]

HEARTBEAT_VAR = "SCALEOUT_HEARTBEAT"
DEFAULT_LIMIT = 15.0
MIN_LIMIT = 0.5  # seconds: 0.1 s beats and slack for a loaded machine
_SLICE = 0.2  # seconds a wait blocks before it looks at the watchdog again


@dataclass(frozen=True)
class PeerFailure:
    """A failed rank, as the watchdog found it.

    Attributes:
        rank: the rank that failed.
        reason: what was seen ("no heartbeat for 15.2 s", "process stopped (SIGSTOP)", ...).
        detected_by: the rank whose watchdog noticed.
        silent_for: seconds since the failed rank's last sign of life, when noticed.
    """

    rank: int
    reason: str
    detected_by: int
    silent_for: float

    def describe(self) -> str:
        return (f"rank {self.rank} failed: {self.reason} (noticed by rank {self.detected_by}, "
                f"{self.silent_for:.1f} s after its last sign of life)")


def heartbeat_limit(environ: Mapping[str, str]) -> float | None:
    """Seconds of silence before a peer is declared failed (None: watchdog off).

    Raises:
        ValueError: ``SCALEOUT_HEARTBEAT`` is not a number of seconds.
    """
    text = environ.get(HEARTBEAT_VAR, "").strip()
    if not text:
        return DEFAULT_LIMIT
    try:
        value = float(text)
    except ValueError as err:
        raise ValueError(f"{HEARTBEAT_VAR} must be seconds (0 = off), got {text!r}") from err
    if value == 0:
        return None
    check_seconds(value, HEARTBEAT_VAR)
    if value < MIN_LIMIT:  # (a heartbeat every limit / 5: below this a busy rank misses it)
        raise ValueError(f"{HEARTBEAT_VAR} must be 0 (off) or at least {MIN_LIMIT:g} seconds, "
                         f"got {text!r}")
    return value


def _process_state(pid: int) -> str | None:
    """Why process ``pid`` (on this machine) cannot answer, or None if it runs."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "process exited"
    return {"T": "process stopped (SIGSTOP)", "t": "process stopped (traced)",
            "Z": "process exited", "X": "process exited"}.get(state)


@dataclass
class _PeerWatch:
    """What one rank knows of the peer it watches."""

    rank: int
    last_seen: float
    last_beat: bytes | None = None
    pid: int | None = None  # 0: not on this machine
    left: bool = False


class Watchdog:
    """The heartbeat thread of one rank (see the module's docstring).

    Store operations can block for good when the store's host (rank 0) is frozen, so the
    thread never decides on the store's silence itself: :meth:`failure` does, from the time
    of the last complete round, and the thread looks at ``/proc`` before touching the store.

    Args:
        job: the job's rendezvous (its authenticated store and join records).
        rank, world: this rank and the job's size.
        limit: seconds of silence before a peer has failed.
    """

    def __init__(self, job: Rendezvous, rank: int, world: int, limit: float) -> None:
        self.rank, self.world, self.limit = rank, world, limit
        self.period = min(1.0, limit / 5)
        self._job = job
        self._reports = os.environ.get(REPORT_DIR_VAR)  # the launcher's (scaleout run)
        self._store = job.connection(timeout=max(self.period, 0.5))
        self._failure: PeerFailure | None = None
        self._lock = threading.Lock()
        self._last_round = time.monotonic()
        self._stop = threading.Event()
        self._published = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="scaleout-watchdog")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def failure(self) -> PeerFailure | None:
        """The first failure seen by any rank of the job, or None."""
        silent = time.monotonic() - self._last_round
        if self._failure is None and self.rank != 0 and silent > self.limit + self.period:
            self._record(PeerFailure(
                rank=0, reason=f"its store (in rank 0's process) stopped answering for "
                               f"{silent:.1f} s (frozen, stopped or unreachable)",
                detected_by=self.rank, silent_for=silent))
        return self._failure

    def leave(self) -> None:
        """Mark this rank as finished (not failed) and stop watching."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)
        try:
            self._store.set(f"left/{self.rank}", "1")
        except (RuntimeError, ValueError):
            pass  # the store host may already be gone

    def _run(self) -> None:
        watch = _PeerWatch((self.rank + 1) % self.world, time.monotonic())
        try:
            record = self._job.peer(watch.rank)
            watch.pid = int(record["pid"]) if record.get("machine") == machine() else 0
            beats = 0
            while not self._stop.wait(self.period) and self.failure() is None:
                beats += 1
                verdict = self._round(watch, beats)
                self._last_round = time.monotonic()
                if verdict is not None:
                    self._record(PeerFailure(rank=watch.rank, reason=verdict,
                                             detected_by=self.rank,
                                             silent_for=time.monotonic() - watch.last_seen))
            found = self._failure
            if found is not None and found.detected_by == self.rank:
                # tell the others (this may block for good if the store's host is frozen)
                self._store.set("failure", json.dumps(asdict(found)))
        except (RuntimeError, ValueError, TypeError):
            pass  # the store is gone: failure() names rank 0 once the limit has passed
        finally:
            self._published.set()

    def settle(self) -> None:
        """Give the thread a moment to tell the other ranks what this rank found, so that
        they name the same rank even if this one exits right after raising."""
        self._published.wait(2 * self.period)

    def _round(self, watch: _PeerWatch, beats: int) -> str | None:
        """One heartbeat: why the watched peer has failed, or None."""
        state = _process_state(watch.pid) if watch.pid and not watch.left else None
        if state is not None and "stopped" in state:
            return state  # before the store, which a stopped rank 0 would never answer
        self._store.set(f"hb/{self.rank}", str(beats))
        if self._store.check(["failure"]):
            self._record(PeerFailure(**json.loads(self._store.get("failure"))))
            return None
        if self.rank == 0 and beats % 5 == 0:
            self._job.report_outsiders()
        ended = exit_of(self._reports, watch.rank)
        if ended is not None:  # (it may have marked itself as left: sys.exit(3) does)
            return ended
        if watch.left:
            return None
        now = time.monotonic()
        if self._store.check([f"hb/{watch.rank}"]):
            beat = self._store.get(f"hb/{watch.rank}")
            if beat != watch.last_beat:
                watch.last_beat, watch.last_seen = beat, now
        silent = now - watch.last_seen
        if state is None and silent <= self.limit:
            return None
        if self._store.check([f"left/{watch.rank}"]):
            watch.left = True  # it finished normally: keep beating, stop watching it
            return None
        return state or f"no heartbeat for {silent:.1f} s (frozen, stopped or unreachable)"

    def _record(self, found: PeerFailure) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = found
        sys.stderr.write(f"scaleout: rank {self.rank}: {found.describe()}\n")
        sys.stderr.flush()
        if self._reports and os.path.isdir(self._reports):  # tell the launcher whom to blame
            with open(os.path.join(self._reports, f"failure-{self.rank}.json"), "w") as report:
                json.dump(asdict(found), report)


_active: list[Watchdog] = []  # the watchdog of this process's job (at most one)
_exit_state = {"crashed": False, "raised": False}  # an uncaught exception / a PeerFailedError


def start(job: Rendezvous, rank: int, world: int, limit: float) -> Watchdog:
    """Start this process's watchdog (stopping any previous one)."""
    stop()
    _active.append(Watchdog(job, rank, world, limit).start())
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    if not getattr(sys.excepthook, "_scaleout", False):
        sys.excepthook = _note_crash(sys.excepthook)
    return _active[0]


def _note_crash(previous: Any) -> Any:
    def hook(*args: Any) -> None:
        _exit_state["crashed"] = True
        previous(*args)

    hook._scaleout = True  # type: ignore[attr-defined]
    return hook


def _at_exit() -> None:
    """At interpreter exit. After a peer failed and this rank raised (or crashed): rank 0
    keeps the store (in its process) up a little so the others can still read which rank
    failed; then the rank leaves at once (status 1), skipping the teardown of
    torch.distributed, which can block for good on a frozen peer. A rank that ends normally
    without ``finalize()`` is marked as left, so that its peers do not report it."""
    if not _active:
        return
    if _active[0].failure() is not None and (_exit_state["crashed"] or _exit_state["raised"]):
        if _active[0].rank == 0:
            time.sleep(2 * _active[0].period + 0.5)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not _exit_state["crashed"]:
        stop()


def stop() -> None:
    """Mark this rank as left and stop its watchdog (at ``finalize()``)."""
    while _active:
        _active.pop().leave()


def failure() -> PeerFailure | None:
    """The failure this process's watchdog knows of, or None (also when none runs)."""
    return _active[0].failure() if _active else None


def raise_if_failed(rank: int, group: str, operation: str) -> None:
    """Raise PeerFailedError (naming the failed rank, this rank, group and operation) if the
    watchdog knows of a failed rank; for wait loops and ``Request.test()``."""
    found = failure()
    if found is not None:
        _active[0].settle()
        _exit_state["raised"] = True
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
    while not event.wait(min(_SLICE, max(deadline - time.monotonic(), 0.0))):
        raise_if_failed(rank, group, operation)
        if time.monotonic() >= deadline:
            return False
    return True


def wait_work(work: Any, seconds: float, rank: int, group: str, operation: str) -> None:
    """``work.wait(timeout=seconds)``, in slices, raising at once when a peer has failed.

    Raises:
        PeerFailedError: the watchdog found a failed rank; names it, this rank, the group
            and the operation.
        RuntimeError: the wait timed out (as ``work.wait`` raises it) or the work failed.
    """
    deadline = time.monotonic() + seconds
    while True:
        raise_if_failed(rank, group, operation)
        remaining = deadline - time.monotonic()
        step = min(remaining, _SLICE) if _active else remaining
        try:
            work.wait(timeout=timedelta(seconds=max(step, 1e-3)))
            return
        except RuntimeError as err:
            if "timed out" in str(err).lower() and remaining > _SLICE:
                continue
            if _active and "timed out" not in str(err).lower():
                # a peer died or left: let the watchdogs name it (within their limit)
                _verdict(_active[0].limit + 2 * _active[0].period)
                if failure() is not None:
                    continue
            raise


def _verdict(seconds: float) -> None:
    """Wait up to ``seconds`` for the watchdog to find a failed rank."""
    deadline = time.monotonic() + seconds
    while failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)
