"""The rank processes of one launch attempt: start, tag output, reap, stop.

:class:`Ranks` is what :func:`scaleout.launch.launcher.launch` runs once per attempt. Each
rank gets its own process group (so that stopping reaches its children) and the
parent-death signal (:mod:`scaleout.launch.lifeline`); one pump thread per rank copies its
output, one waiter thread per rank records the exact order in which ranks exit.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from typing import IO

from scaleout.launch.lifeline import REPORT_DIR_VAR, die_with_parent, note_exit

__all__ = ["Ranks", "signal_name"]


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

    def start(self, rank: int, argv: list[str], env: dict[str, str], prefix: bool) -> None:
        try:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    bufsize=1, start_new_session=True, errors="replace",
                                    preexec_fn=die_with_parent(os.getpid()))
        except OSError as err:
            raise ValueError(f"cannot start rank {rank} ({argv[0]}): {err.strerror}") from err
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
        for line in proc.stdout:
            self.tails[rank].append(line.rstrip("\n"))
            with self.lock:
                self.out.write(tag + line)
                self.out.flush()

    def _reap(self, rank: int, proc: subprocess.Popen[str], _prefix: bool) -> None:
        code = proc.wait()  # the only waiter of this process: its exit time is exact
        if code != 0:  # its peers' watchdogs name it (lifeline.exit_of)
            note_exit(self.reports, rank, code)
        with self.lock:
            self.exits.append((time.monotonic(), rank, code))
        self.changed.set()

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal = signum
        self.changed.set()

    def watch(self, settle: float = 0.0) -> tuple[int, int] | None:
        """Wait until every rank exits (None), one fails ((rank, code)) or a signal (None).

        After a failure the others get ``settle`` seconds to end by themselves (a survivor
        that names the failed rank, then exits) before the caller stops them.
        """
        failed: list[tuple[int, int]] = []
        until = float("inf")
        while self.signal is None:
            with self.lock:
                failed = [(rank, code) for _, rank, code in self.exits if code != 0]
                done = len(self.exits) == len(self.procs)
            if done:
                break
            if failed and until == float("inf"):
                until = time.monotonic() + settle
            if time.monotonic() >= until:
                break
            self.changed.wait(min(0.5, max(until - time.monotonic(), 0.0)))
            self.changed.clear()
        return failed[0] if failed and self.signal is None else None

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

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, code) of the rank whose non-zero exit came first, if any."""
        with self.lock:
            failed = [(rank, code) for _, rank, code in sorted(self.exits) if code != 0]
        return failed[0] if failed else None


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; the number as text when it names no signal."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
