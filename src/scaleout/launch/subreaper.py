"""What a rank started in a session of its own ends with the job too.

The launcher stops each rank's process group, and the guardian (:mod:`scaleout.launch.guardian`)
does the same if the launcher dies; a process a rank started with ``setsid`` (or
``start_new_session=True``, a daemon's double fork) is in neither group and outlived the job.
So the launcher makes itself a *child subreaper* (Linux's
``prctl(PR_SET_CHILD_SUBREAPER)``): a descendant whose parent exits is re-parented to the
launcher instead of to init. When an attempt ends (its ranks stopped), :func:`end_adopted`
kills every process the launcher adopted that carries its ranks' environment (this
launcher's ``SCALEOUT_LAUNCHER_ID``: a descendant of its ranks, not some other child of a
program that launches in-process), and its group, then reaps it; what those had started is
adopted in turn and ended in the next round. Elsewhere (no ``prctl``) nothing changes.

A launcher killed with ``kill -9`` can end nothing: its guardian (:mod:`scaleout.launch.guardian`)
then ends every process carrying its attempt's token. Not covered: a descendant
that cleared its environment is not known as the job's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from scaleout.launch.environment import proc_stat
from scaleout.launch.lifeline import LAUNCHER_ID_VAR, launcher_env

__all__ = ["become_subreaper", "starting", "note_started", "adopted", "end_adopted"]

_PR_SET_CHILD_SUBREAPER = 36
_ROUNDS = 8  # adoption rounds: each ends one more level of session-leaving descendants
_state = {"on": False}
_started: set[int] = set()  # the children this process started itself (ranks, guardians)
# held from a child's start to its note, and while adopted ones are found and killed: a
# launch starting its ranks while another in the same process ends (the bench's warm ranks)
# must not have a rank taken for an adopted process between its exec and its note (it was
# killed, reaped there, and its own Popen.wait() then read exit code 0)
_starting = threading.RLock()


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants; whether that worked."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        _state["on"] = prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (AttributeError, OSError):
        _state["on"] = False
    return _state["on"]


@contextmanager
def starting() -> Iterator[None]:
    """Hold while starting a child and calling :func:`note_started` for it, so that
    :func:`end_adopted` in another thread never finds it in between."""
    with _starting:
        yield


def note_started(pid: int) -> None:
    """A child this process started itself: never taken for an adopted one."""
    _started.add(pid)


def adopted() -> list[int]:
    """This process's children that it did not start itself (:func:`note_started`) and that
    carry its ranks' environment: its ranks' descendants re-parented to it."""
    me, found = os.getpid(), []
    mark = launcher_env().get(LAUNCHER_ID_VAR)
    if mark is None:  # (not a launcher: no ranks, nothing of theirs to adopt)
        return []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    setting = f"{LAUNCHER_ID_VAR}={mark}"
    for entry in entries:
        if entry.isdigit() and int(entry) not in _started:
            fields = proc_stat(entry)
            if (fields is not None and len(fields) > 1 and int(fields[1]) == me
                    and _carries(entry, setting)):
                found.append(int(entry))
    return found


def _carries(pid: str, setting: str) -> bool:
    """Whether process ``pid`` was started with ``setting`` (``NAME=value``) in its
    environment. A zombie's reads empty: it is left (it holds nothing, and goes with this
    process)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return setting.encode() in environ.read().split(b"\0")
    except OSError:
        return False


def end_adopted(settle: float = 0.05) -> list[int]:
    """SIGKILL every adopted process (and its process group) and reap it, in rounds until
    none is left; the pids ended (none unless :func:`become_subreaper` worked)."""
    ended: list[int] = []
    for _ in range(_ROUNDS if _state["on"] else 0):
        with _starting:  # (no child of ours is between its start and its note)
            found = adopted()
            for pid in found:
                for kill in (lambda: os.killpg(os.getpgid(pid), signal.SIGKILL),
                             lambda: os.kill(pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
        if not found:
            break
        for pid in found:
            try:
                os.waitpid(pid, 0)  # (ours since its parent exited: reap it)
            except ChildProcessError:
                pass
        ended += found
        time.sleep(settle)  # (their children are re-parented to us as they die)
    return ended
