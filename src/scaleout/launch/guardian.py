"""What a rank started dies with the launcher, ``kill -9`` included.

The parent-death signal (:mod:`scaleout.launch.lifeline`) reaches the rank only: a process
the rank started (``subprocess.Popen(["sleep", "300"])``), or the rank under a wrapper that
does not exec (``sh -c "python3 train.py; echo done"``), would be left running. So each
attempt of the launcher starts a :class:`Guardian`: a small Python process in a session of
its own that reads, from a pipe, the process group of every rank it starts. When the
attempt ends (its ranks stopped) the launcher says ``done``; when the pipe closes without it
(the launcher died), the guardian sends SIGKILL to every group, and then, in rounds until
none is left, to every process that carries its attempt's :data:`ATTEMPT_VAR` in its
environment (a random token every rank of the attempt gets): what a rank started in a
session of its own (``setsid``, a daemon's double fork), which the launcher, the subreaper
of such processes (:mod:`scaleout.launch.subreaper`), can no longer end. The token is the
attempt's, not the launcher's identity: a program that launches in-process several times at
once (``bench train``'s warm ranks) must not have one attempt's guardian end another's
ranks. It reads until the pipe closes, so it needs no timing and costs nothing meanwhile.
"""

from __future__ import annotations

import subprocess
import sys

from scaleout.launch.subreaper import note_started, starting

__all__ = ["ATTEMPT_VAR", "Guardian"]

#: Every rank of one attempt gets this variable with the attempt's token (``Ranks.token``).
ATTEMPT_VAR = "SCALEOUT_ATTEMPT_TOKEN"

_CODE = """
import os, signal, sys, time
for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
groups = set()
for word in sys.stdin.read().split():  # until the launcher closes the pipe, or dies
    if word == "done":
        sys.exit(0)
    groups.add(int(word))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
mark = sys.argv[1].encode()
for _ in range(8):  # the attempt's processes in sessions of their own
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open("/proc/" + entry + "/environ", "rb") as environ:
                    if mark in environ.read().split(b"\\0"):
                        found.append(int(entry))
            except OSError:  # (gone, a zombie reads empty, or another user's)
                pass
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.05)
"""


class Guardian:
    """The process that signals the ranks' process groups if the launcher dies."""

    def __init__(self, token: str) -> None:
        """``token``: the attempt's :data:`ATTEMPT_VAR` value, which its ranks carry."""
        with starting():
            try:
                self._proc: subprocess.Popen[str] | None = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _CODE, f"{ATTEMPT_VAR}={token}"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                    start_new_session=True)
                note_started(self._proc.pid)
            except OSError:  # best effort: the parent-death signal still reaches the ranks
                self._proc = None

    def _send(self, word: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(word + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # it is gone (killed by someone)
            self._proc = None

    def add(self, group: int) -> None:
        """Signal process group ``group`` if the launcher dies."""
        self._send(str(group))

    def close(self) -> None:
        """The launcher ends normally: the guardian leaves without signalling anything."""
        proc = self._proc
        self._send("done")
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None
