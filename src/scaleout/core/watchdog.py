"""Failure detection apart from the collective timeout: heartbeats through the job's store.

Every rank runs a daemon thread that, every ``period`` seconds, bumps its heartbeat entry in
the (authenticated) store and watches its successor ``(rank + 1) % world``: a successor
whose heartbeat stops moving for ``limit`` seconds (frozen, SIGSTOP, a dead host), or whose
process is gone or stopped (seen at once in ``/proc`` when it shares this machine), has
failed; so has the store's host (rank 0) when its process is gone or stopped, when its
store breaks the connection, or when it stops answering for ``limit`` seconds. The rank that
notices writes the failure to the store; every rank reads it within one period. Waits then
fail fast: :func:`~scaleout.core.peer_waits.wait_work` (used by
:class:`~scaleout.core.request.Request`) waits in slices and raises
:class:`~scaleout.core.errors.PeerFailedError` naming the *failing* rank.

``SCALEOUT_HEARTBEAT`` sets ``limit`` (seconds, default 15; ``0`` turns the watchdog off).
A rank that calls ``finalize()`` marks itself as left, so finishing is not failing. A rank
that exits without it writes that it *departed*: every peer that waits on a collective
after that (or is blocked in one) raises PeerFailedError naming it; a peer that does not
communicate any more says nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from scaleout.core import progress, stalls
from scaleout.core.failures import (DEFAULT_LIMIT, DEPARTED, HEARTBEAT_VAR, PeerFailure,
                                    StoreHostDown, broken_by_communication, first_line,
                                    heartbeat_limit, process_state)
from scaleout.launch.lifeline import REPORT_DIR_VAR, exit_of
from scaleout.launch.secret import ForgedValue
from scaleout.launch.environment import machine

if TYPE_CHECKING:  # (a run-time import would make core and launch import each other)
    from scaleout.launch.rendezvous import Rendezvous

__all__ = ["HEARTBEAT_VAR", "DEFAULT_LIMIT", "PeerFailure", "Watchdog", "start", "stop",
           "failure", "blocked", "active", "note_raised", "heartbeat_limit"]


@dataclass
class _PeerWatch:
    """What one rank knows of the peer it watches."""

    rank: int
    last_seen: float
    last_beat: bytes | None = None
    pid: int | None = None  # 0: not on this machine
    left: bool = False


#: the ``beat`` of a rank's last heartbeat, written as it leaves (finalize() or exit)
_LEFT = "left"


class Watchdog:
    """The heartbeat thread of one rank (see the module's docstring).

    Store operations can block for good when the store's host (rank 0) is frozen, so the
    thread never decides on the store's silence itself: :meth:`failure` does, from the time
    of the last complete round, and the thread looks at ``/proc`` before touching the store.
    A store that breaks the connection, or whose host process is gone, names the host at once.

    Args:
        job: the job's rendezvous (its authenticated store and join records).
        rank, world: this rank and the job's size.
        limit: seconds of silence before a peer has failed.
        store_host: the rank whose process serves the store (``None``: not a rank, e.g.
            torchrun's agent).
    """

    def __init__(self, job: Rendezvous, rank: int, world: int, limit: float,
                 store_host: int | None = 0) -> None:
        self.rank, self.world, self.limit, self.store_host = rank, world, limit, store_host
        self.period = min(1.0, limit / 5)
        self._job = job
        self._reports = os.environ.get(REPORT_DIR_VAR)  # the launcher's (scaleout run)
        self._store = job.connection(timeout=max(self.period, 0.5))
        self._failure: PeerFailure | None = None
        # a rank that left without finalize(), and when that was read
        self._departed: tuple[PeerFailure, float] | None = None
        self._host_pid = 0  # the store host's pid when it runs on this machine
        self._store_lost = False  # the thread's store operation failed: the store is gone
        self._tamper_seen = False  # a heartbeat entry was deleted (reported once)
        self._lock = threading.Lock()
        self._last_round = time.monotonic()
        self._round_began: float | None = None  # a round is under way since (None: none)
        self._last_check = time.monotonic()  # the last call of failure()
        self._stop = threading.Event()
        self._published = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="scaleout-watchdog")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def failure(self) -> PeerFailure | None:
        """The first failure seen by any rank of the job, or None. The store's host is blamed
        for a round stuck on the store longer than the limit; a call more than ``limit / 2``
        after the previous one decides nothing (the process was stopped with the job, say by
        Slurm's ``scontrol suspend``, or starved: its clocks jumped; stop 46)."""
        now = time.monotonic()
        resumed, self._last_check = now - self._last_check > self.limit / 2, now
        began = self._round_began
        if (self._failure is None and not resumed and began is not None
                and now - began > self.limit and self._host_may_fail()):
            silent = now - self._last_round
            self._record(PeerFailure(
                rank=self.store_host, detected_by=self.rank,  # type: ignore[arg-type]
                silent_for=silent,
                reason=f"its store (in rank {self.store_host}'s process) stopped answering for "
                       f"{silent:.1f} s (frozen, stopped or unreachable)"))
        return self._failure

    def blocked(self) -> PeerFailure | None:
        """:meth:`failure` for a rank that waits on its peers: to it, a rank that departed
        (exited without ``finalize()``) has failed too."""
        found = self.failure()
        if found is None and self._departed is not None:
            gone, seen = self._departed
            self._record(replace(gone, detected_by=self.rank, silent_for=time.monotonic() - seen))
            found = self._failure
        return found

    def _host_may_fail(self) -> bool:
        """Whether the store's silence or errors mean its host failed: not when this rank
        hosts it or is leaving, nor once the host departed (that is for :meth:`blocked`)."""
        if self.store_host in (None, self.rank) or self._stop.is_set():
            return False
        return self._departed is None or self._departed[0].rank != self.store_host

    def leave(self, departed: bool = False) -> None:
        """Mark this rank as finished and stop watching: left (``finalize()``), or departed
        (at exit without it: its peers fail if they still wait on it)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)
        if self._store_lost:
            return  # (each operation on it would fail and print a c10d warning)
        try:
            if departed and self._failure is None and not self._store.check(["departed"]):
                self._store.set("departed", json.dumps(asdict(PeerFailure(
                    rank=self.rank, reason=DEPARTED, detected_by=self.rank, silent_for=0.0))))
            # the last heartbeat says it too: an outsider may delete left/R, not forge this
            self._store.set(f"hb/{self.rank}", json.dumps({"beat": _LEFT, **progress.snapshot()}))
            self._store.set(f"left/{self.rank}", "1")
            if self.rank == self.store_host:
                self._outlive_peers()
        except (RuntimeError, ValueError):
            pass  # the store host may already be gone

    def _outlive_peers(self) -> None:
        """The store lives in this process: keep it up until every rank has left (right
        after finalize()'s barrier), at most ``2 * period + 0.5`` s, so that no peer takes
        its end for a failure and a departure can still be read."""
        keys = [f"left/{rank}" for rank in range(self.world)]
        deadline = time.monotonic() + 2 * self.period + 0.5
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _run(self) -> None:
        try:
            watch = _PeerWatch((self.rank + 1) % self.world, time.monotonic())
            watch.pid = self._local_pid(watch.rank)
            if self.store_host is not None and self.store_host != self.rank:
                self._host_pid = self._local_pid(self.store_host)
            self._beat(watch)
        except (StoreHostDown, RuntimeError, ValueError, TypeError) as err:
            self._store_lost = True
            self._lost_store(err)  # (the thread ends: its store connection is spent)
        finally:
            self._published.set()

    def _local_pid(self, rank: int) -> int:
        """``rank``'s pid when it runs on this machine (its ``/proc`` is ours to read), else 0."""
        record = self._job.peer(rank)
        return int(record["pid"]) if record.get("machine") == machine() else 0

    def _beat(self, watch: _PeerWatch) -> None:
        beats = 0
        while not self._stop.wait(self.period) and self.failure() is None:
            beats += 1
            self._round_began = began = time.monotonic()
            stalls.note_late(self._last_round + self.period, began)
            idle = began - self._last_round - self.period  # this thread did not run...
            if idle > self.period:  # ...(the process stopped or starved): not the peer's
                watch.last_seen = min(watch.last_seen + idle, began)  # silence to count
            verdict = self._round(watch, beats)
            self._last_round, self._round_began = time.monotonic(), None
            if verdict is not None:
                self._record(PeerFailure(rank=watch.rank, reason=verdict, detected_by=self.rank,
                                         silent_for=time.monotonic() - watch.last_seen))
        found = self._failure
        if found is not None and found.detected_by == self.rank:
            # tell the others (this may block for good if the store's host is frozen)
            self._store.set("failure", json.dumps(asdict(found)))

    def _lost_store(self, err: BaseException) -> None:
        """The store failed with ``err``: name its host when that is conclusive (its process
        is gone or stopped, or the connection broke). A store that only timed out is left to
        :meth:`failure` (silent for the limit: frozen or far away)."""
        if self._failure is not None or not self._host_may_fail():
            return
        if isinstance(err, StoreHostDown):
            evidence: str | None = str(err)
        else:
            evidence = process_state(self._host_pid) if self._host_pid else None
            said = first_line(err)
            if evidence is None and ("timeout" in said.lower() or "timed out" in said.lower()):
                return
            evidence = f"{evidence} ({said})" if evidence else f"its store failed: {said}"
        self._record(PeerFailure(
            rank=self.store_host, detected_by=self.rank,  # type: ignore[arg-type]
            reason=f"rank {self.store_host} (host of the rendezvous store) is unreachable: "
                   f"{evidence}", silent_for=time.monotonic() - self._last_round))

    def declare(self, found: PeerFailure) -> None:
        """Record, and tell the others, a failure found elsewhere (``core/diverged.py``)."""
        self._record(found)

    def connection(self) -> Any:
        """A store connection of its own (the thread's is in use), with the thread's timeout."""
        return self._job.connection(timeout=max(self.period, 0.5))

    def settle(self) -> None:
        """Give the thread a moment to tell the other ranks what this rank found, so that
        they name the same rank even if this one exits right after raising."""
        self._published.wait(2 * self.period)

    def _round(self, watch: _PeerWatch, beats: int) -> str | None:
        """One heartbeat: why the watched peer has failed, or None."""
        state = process_state(watch.pid) if watch.pid and not watch.left else None
        if state is not None and "stopped" in state:
            return state  # before the store, which a stopped rank 0 would never answer
        host = process_state(self._host_pid) if self._host_pid else None
        if host is not None:
            raise StoreHostDown(host)
        if beats > 1:  # this rank's own entry, written a period ago, must still be there
            mine, forged = self._entry(f"hb/{self.rank}")
            if mine is None or forged:
                self._tampered(self.rank)
        beat = {"beat": beats, **progress.snapshot()}  # (the calls: for lagging())
        self._store.set(f"hb/{self.rank}", json.dumps(beat))
        if self._read_news():
            return None
        if self.rank == 0 and beats % 5 == 0:
            self._job.report_outsiders()
        ended = exit_of(self._reports, watch.rank)
        if ended is not None:  # (it may have marked itself as left: sys.exit(3) does)
            return ended
        if watch.left:
            return None
        now = time.monotonic()
        beat, forged = self._entry(f"hb/{watch.rank}")
        if beat is not None:
            if beat != watch.last_beat:
                watch.last_beat, watch.last_seen = beat, now
                if json.loads(beat).get("beat") == _LEFT:  # its last: it finished normally
                    watch.left = True
                    return None
        elif forged or watch.last_beat is not None:  # (seen before, gone now: deleted)
            self._tampered(watch.rank)
            watch.last_seen = now
        silent = now - watch.last_seen
        if state is None and silent <= self.limit:
            return None
        if self._store.check([f"left/{watch.rank}"]):
            watch.left = True  # it finished normally: keep beating, stop watching it
            return None
        return state or f"no heartbeat for {silent:.1f} s (frozen, stopped or unreachable)"

    def _entry(self, key: str) -> tuple[bytes | None, bool]:
        """``key``'s value (None: absent) and whether a value that is not the job's stood
        there instead (then None too: an outsider's value is read as no value)."""
        try:
            return self._store.get_if_present(key), False
        except ForgedValue:
            return None, True

    def _tampered(self, rank: int) -> None:
        """``rank``'s heartbeat entry vanished after it had been written or read, or holds a
        value not sealed with the job's token: a process outside the job did it (values are
        sealed, names are not protected). Not the peer's silence: say so, once, and do not
        blame the peer. (Under continuous tampering a peer frozen on another host is found
        by the collective timeout; a local one still by ``/proc``.) Each rank also reads its
        own entry back before it writes the next: a whole period's window, where the peer's,
        read just after the peer wrote it, may be milliseconds."""
        if self._tamper_seen:
            return
        self._tamper_seen = True
        sys.stderr.write(f"scaleout: rank {self.rank}: rank {rank}'s heartbeat entry "
                         "was deleted or overwritten in the job's store by a process outside "
                         f"the job (no rank does either); rank {rank} is not blamed for "
                         "its absence\n")
        sys.stderr.flush()

    def _read_news(self) -> bool:
        """What the other ranks wrote: a failure (then True, recorded) or a departure. An
        outsider's value under either name is no news."""
        found, _ = self._entry("failure")
        if found is not None:
            self._record(PeerFailure(**json.loads(found)))
            return True
        gone = None if self._departed is not None else self._entry("departed")[0]
        if gone is not None:
            self._departed = (PeerFailure(**json.loads(gone)), time.monotonic())
        return False

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
#: an uncaught exception / a PeerFailedError raised / an uncaught communication error
#: (:func:`~scaleout.core.failures.broken_by_communication`)
_exit_state = {"crashed": False, "raised": False, "broken": False}


def start(job: Rendezvous, rank: int, world: int, limit: float,
          store_host: int | None = 0) -> Watchdog:
    """Start this process's watchdog (stopping any previous one)."""
    stop()
    _active.append(Watchdog(job, rank, world, limit, store_host).start())
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
    if not getattr(sys.excepthook, "_scaleout", False):
        sys.excepthook = _note_crash(sys.excepthook)
    return _active[0]


def _note_crash(previous: Any) -> Any:
    def hook(kind: Any, error: Any, trace: Any) -> None:
        _exit_state["crashed"] = True
        _exit_state["broken"] = broken_by_communication(error)
        previous(kind, error, trace)

    hook._scaleout = True  # type: ignore[attr-defined]
    return hook


def _at_exit() -> None:
    """At interpreter exit. After a peer failed and this rank raised (or crashed), and after
    an uncaught communication error (:func:`broken_by_communication`: a timeout, say), once its
    traceback is printed: the rank leaves at once (status 1), skipping the teardown of
    torch.distributed, which can block for good on a frozen peer or abort on work still
    pending ("terminate called without an active exception"); rank 0 first keeps the store
    (in its process) up a little so the others can still read which rank failed or lags. A rank that
    ends normally without ``finalize()`` departs: its peers fail if they still wait on it."""
    if not _active:
        return
    dog = _active[0]
    failed = dog.failure() is not None and (_exit_state["crashed"] or _exit_state["raised"])
    if failed or _exit_state["broken"]:
        if dog.rank == dog.store_host:  # (the others read a failure or lagging() from it)
            time.sleep(2 * dog.period + 0.5)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not _exit_state["crashed"]:
        stop(departed=True)


def stop(departed: bool = False) -> None:
    """Stop this rank's watchdog: at ``finalize()`` (left), or at exit without it (departed)."""
    while _active:
        _active.pop().leave(departed)


def active() -> Watchdog | None:
    """This process's watchdog, or None when none runs."""
    return _active[0] if _active else None


def note_raised() -> None:
    """A PeerFailedError was raised: at exit this rank leaves at once (see :func:`_at_exit`)."""
    _exit_state["raised"] = True


def failure() -> PeerFailure | None:
    """The failure this process's watchdog knows of, or None (also when none runs)."""
    return _active[0].failure() if _active else None


def blocked() -> PeerFailure | None:
    """:func:`failure` for a rank that waits on its peers (a departed rank counts)."""
    return _active[0].blocked() if _active else None

