"""The rank processes of one launch attempt: start, tag output, reap, stop.

:class:`Ranks` is what :func:`scaleout.launch.launcher.launch` runs once per attempt. Each
rank gets its own process group (so that stopping reaches its children), the parent-death
signal (:mod:`scaleout.launch.lifeline`) and the attempt's guardian
(:mod:`scaleout.launch.guardian`), which signals its group if the launcher dies; one pump
thread per rank copies its output, one waiter thread per rank records the exact order in
which ranks exit.

A pump holds at most :data:`PIECE` characters of a line: a longer line (a rank writing
without newlines) is passed on in pieces, each tagged as a line of its own; the failure tail
keeps the first :data:`TAIL_LINE` characters of each line. When the launcher's output is
gone (``scaleout run ... | head``) the pumps keep reading and drop what they read, so the
ranks never block on a full pipe.
"""

from __future__ import annotations

import collections
import os
import secrets
import signal
import subprocess
import threading
import time
from typing import IO

from scaleout.launch.guardian import ATTEMPT_VAR, Guardian
from scaleout.launch.subreaper import end_adopted, note_started, starting
from scaleout.launch.lifeline import REPORT_DIR_VAR, die_with_parent, note_exit

__all__ = ["Ranks", "signal_name", "write_out", "PIECE", "TAIL_LINE"]

#: characters of one line a pump holds at most: a longer line is passed on in pieces
PIECE = 64 * 1024
#: characters of one line kept for the failure report
TAIL_LINE = 2000


def write_out(out: IO[str], text: str) -> bool:
    """Write ``text`` to ``out`` and flush; False when ``out`` cannot take it (its reader is
    gone: then its file descriptor is pointed at ``/dev/null``, so that later writes and the
    interpreter's last flush do not fail)."""
    try:
        out.write(text)
        out.flush()
        return True
    except BrokenPipeError:
        _discard(out)
    except (OSError, ValueError):  # (a closed stream)
        pass
    return False


def _discard(out: IO[str]) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, out.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError):
        pass


def _piece_text(tag: str, piece: str, start: bool) -> str:
    """What the pump writes for ``piece`` (``start``: it begins a line): with a tag, a piece
    that does not end its line is ended here, so the next piece gets a tag of its own."""
    if not tag:
        return piece
    if piece.endswith("\n"):
        return "" if piece == "\n" and not start else tag + piece
    return tag + piece + "\n"


def _tail_line(piece: str) -> str:
    line = piece.rstrip("\n")
    if len(line) <= TAIL_LINE:
        return line
    return f"{line[:TAIL_LINE]} [... cut: the line is longer than {TAIL_LINE} characters]"


class Ranks:
    """The running rank processes, their output pumps, exit waiters and last lines of each."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.reports: str | None = None  # the attempt's report folder (every rank's env)
        self.tails: dict[int, collections.deque[str]] = {}
        self.threads: list[threading.Thread] = []
        self.exits: list[tuple[float, int, int]] = []  # (time, rank, code) in order of exit
        self.changed = threading.Event()  # a rank exited, or the launcher got a signal
        self.signal: int | None = None
        self.signal_at: float | None = None  # when the launcher got it (time.monotonic())
        self.lingered: list[int] = []  # ranks still running ``linger`` s after a clean exit
        self.dropping = False  # the output is gone: the pumps drop what they read
        self.guard: Guardian | None = None
        self.token = secrets.token_hex(8)  # every rank's ATTEMPT_VAR: what its guardian ends

    def start(self, rank: int, argv: list[str], env: dict[str, str], prefix: bool) -> None:
        env = {**env, ATTEMPT_VAR: self.token}
        with starting():
            try:
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        text=True, bufsize=1, start_new_session=True,
                                        errors="replace", preexec_fn=die_with_parent(os.getpid()))
            except OSError as err:
                raise ValueError(f"cannot start rank {rank} ({argv[0]}): {err.strerror}") from err
            note_started(proc.pid)
        if self.guard is None:
            self.guard = Guardian(self.token)
        self.guard.add(proc.pid)  # (the rank leads its process group)
        self.procs[rank] = proc
        self.reports = env.get(REPORT_DIR_VAR)
        self.tails[rank] = collections.deque(maxlen=30)
        for target in (self._pump, self._reap):
            thread = threading.Thread(target=target, args=(rank, proc, prefix), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pump(self, rank: int, proc: subprocess.Popen[str], prefix: bool) -> None:
        assert proc.stdout is not None
        tag = f"[rank {rank}] " if prefix else ""
        start = True  # the piece begins a line
        while piece := proc.stdout.readline(PIECE):
            if start:
                self.tails[rank].append(_tail_line(piece))
            self._write(_piece_text(tag, piece, start))
            start = piece.endswith("\n")

    def _write(self, text: str) -> None:
        with self.lock:
            if text and not self.dropping and not write_out(self.out, text):
                self.dropping = True  # keep reading: a rank blocked on its pipe would hang

    def _reap(self, rank: int, proc: subprocess.Popen[str], _prefix: bool) -> None:
        code = proc.wait()  # the only waiter of this process: its exit time is exact
        if code != 0:  # its peers' watchdogs name it (lifeline.exit_of)
            note_exit(self.reports, rank, code)
        with self.lock:
            self.exits.append((time.monotonic(), rank, code))
        self.changed.set()

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal, self.signal_at = signum, time.monotonic()
        self.changed.set()

    def watch(self, settle: float = 0.0, linger: float | None = None) -> tuple[int, int] | None:
        """Wait until every rank exits (None), one fails ((rank, code)) or a signal (None).

        After a failure the others get ``settle`` seconds to end by themselves (a survivor
        that names the failed rank, then exits) before the caller stops them. With
        ``linger``, after the first rank exits with 0 the others get that many seconds to
        exit too; those still running then are listed in :attr:`lingered` (None).
        """
        failed: list[tuple[int, int]] = []
        settled = float("inf")  # when the survivors of a failure are stopped
        while self.signal is None:
            with self.lock:
                failed = [(rank, code) for _, rank, code in self.exits if code != 0]
                clean = [at for at, _, code in self.exits if code == 0]
                done = len(self.exits) == len(self.procs)
            if done:
                break
            if failed and settled == float("inf"):
                settled = time.monotonic() + settle
            until = (settled if failed or not clean or linger is None
                     else clean[0] + linger)
            if time.monotonic() >= until:
                if not failed:
                    self.lingered = self._running()
                break
            self.changed.wait(min(0.5, max(until - time.monotonic(), 0.0)))
            self.changed.clear()
        return failed[0] if failed and self.signal is None else None

    def _running(self) -> list[int]:
        with self.lock:
            gone = {rank for _, rank, _ in self.exits}
        return sorted(rank for rank in self.procs if rank not in gone)

    def stop(self, grace: float) -> None:
        """SIGTERM to every rank's process group, SIGKILL after ``grace`` seconds; then
        SIGKILL to every group, so that nothing a rank started outlives the job (a rank that
        exited first leaves its children in its group: they were orphans before)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._signal_groups(sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not self._all_exited():
                time.sleep(0.02)
            if self._all_exited():
                break
        self._signal_groups(signal.SIGKILL)
        if self.guard is not None:
            self.guard.close()
        end_adopted()  # what a rank started in a session of its own, orphaned since
        for thread in self.threads:
            thread.join(timeout=2.0)

    def _signal_groups(self, sig: signal.Signals) -> None:
        for proc in self.procs.values():  # (each rank leads its own group)
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty

    def _all_exited(self) -> bool:
        with self.lock:
            return len(self.exits) == len(self.procs)

    def first_failure(self, before: float | None = None) -> tuple[int, int] | None:
        """(rank, code) of the rank whose non-zero exit came first (before ``before``, a
        ``time.monotonic()``, when given), if any."""
        with self.lock:
            failed = [(rank, code) for at, rank, code in sorted(self.exits)
                      if code != 0 and (before is None or at < before)]
        return failed[0] if failed else None

    def exited_before(self, rank: int) -> list[tuple[int, int, float]]:
        """(rank, code, seconds earlier) of each rank that exited before ``rank`` did."""
        with self.lock:
            exits = sorted(self.exits)
        when = next((at for at, who, _ in exits if who == rank), None)
        if when is None:
            return []
        return [(who, code, when - at) for at, who, code in exits if at < when and who != rank]


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; the number as text when it names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
