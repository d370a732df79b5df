"""A rank dies with its launcher: a parent-death signal, and a launcher watch as a fallback.

The launcher starts each rank with :func:`die_with_parent` as ``preexec_fn`` (Linux's
``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the rank when the launcher dies, even
with ``kill -9``, even when the rank is stopped or frozen). That signal reaches the direct
child only: what the rank started is left to the attempt's guardian
(:mod:`scaleout.launch.guardian`). On systems without ``prctl``, when a wrapper (``ip netns
exec``, ``setpriv``) clears the signal, or when a wrapper that does not exec (``sh -c``)
stands between launcher and rank, :func:`watch_parent`, started by :func:`scaleout.init`,
polls the launcher (by pid and start time, from any depth) and, once it is gone, kills the
rank's process group.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping

from scaleout.launch.environment import machine, proc_stat

__all__ = ["LAUNCHER_PID_VAR", "LAUNCHER_ID_VAR", "REPORT_DIR_VAR", "die_with_parent",
           "launcher_env", "watch_parent", "blamed", "note_exit", "exit_of"]

LAUNCHER_PID_VAR = "SCALEOUT_LAUNCHER_PID"
#: ``<boot id>/<pid namespace>/<start time>`` of the launcher (:func:`launcher_env`).
LAUNCHER_ID_VAR = "SCALEOUT_LAUNCHER_ID"
#: A directory where a rank's watchdog writes ``failure-<rank>.json`` naming a failed peer.
REPORT_DIR_VAR = "SCALEOUT_REPORT_DIR"
_PR_SET_PDEATHSIG = 1
_THREAD = "scaleout-parent-watch"


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive SIGKILL when ``parent_pid`` exits.

    ``prctl`` is looked up here, in the parent: the child (forked from a process with
    threads) only makes the call. It also leaves at once if its parent already died between
    the fork and the ``prctl`` call (then ``getppid()`` differs).
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: watch_parent() is the fallback
        prctl = None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _identity(pid: int | str) -> str | None:
    """``<boot id>/<pid namespace>/<start time>`` of a live process (a reused pid has another
    start time), or None when it is gone or there is no ``/proc``."""
    place, fields = machine(), proc_stat(pid)
    if not place or fields is None or fields[0] in "ZX":
        return None
    return f"{place}/{fields[19]}"


def launcher_env() -> dict[str, str]:
    """What the launcher tells its ranks about itself: its pid and, where ``/proc`` exists,
    its identity (``SCALEOUT_LAUNCHER_ID``), so that :func:`watch_parent` can watch it from
    any depth below (under a wrapper that forks) without mistaking a reused pid for it."""
    identity = _identity("self")
    env = {LAUNCHER_PID_VAR: str(os.getpid())}
    if identity is not None:
        env[LAUNCHER_ID_VAR] = identity
    return env


def _leave(pid: int, group: bool) -> None:
    """The launcher is gone: SIGKILL to this rank's process group (what it and a wrapper
    above it started) when the launcher started it in a group of its own, else to itself."""
    try:  # (the launcher read this output: most likely no one reads it now)
        sys.stderr.write(f"scaleout: rank pid {os.getpid()}: the launcher (pid {pid}) is "
                         f"gone; leaving{' with its process group' if group else ''}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if group:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int, identity: str) -> bool:
    """Whether the launcher still runs: by identity, or (no ``/proc``) as the parent."""
    return _identity(pid) == identity if identity else os.getppid() == pid


def _watch(pid: int, identity: str, group: bool, period: float,
           stop: threading.Event) -> None:
    while _alive(pid, identity):
        if stop.wait(period):
            return
    _leave(pid, group)


def watch_parent(environ: Mapping[str, str], period: float = 1.0) -> threading.Event | None:
    """Leave once the launcher named in ``SCALEOUT_LAUNCHER_PID`` is gone: SIGKILL to this
    rank's process group when the launcher started it in a group of its own (so that what
    the rank started, and a wrapper that did not exec, go too), else to this process.

    The launcher is watched by its identity (``SCALEOUT_LAUNCHER_ID``: boot id, pid
    namespace, start time), whether it is this process's parent or not. Without that
    variable only a parent can be watched (by its identity, read now; without ``/proc`` by
    the parent pid).

    Returns:
        An event that stops the watch when set, or ``None`` when this process was not
        started by ``scaleout run``, cannot see its launcher (another machine or pid
        namespace; a wrapper without ``SCALEOUT_LAUNCHER_ID``), or a watch already runs.
    """
    value = environ.get(LAUNCHER_PID_VAR, "")
    if not value.isdigit() or any(thread.name == _THREAD for thread in threading.enumerate()):
        return None
    pid, identity = int(value), environ.get(LAUNCHER_ID_VAR, "")
    if identity and identity.rsplit("/", 1)[0] != machine():
        return None  # its pids are not ours to read
    if not identity:
        if pid != os.getppid():
            return None
        identity = _identity(pid) or ""
    try:  # a group of its own, not the launcher's (which may hold the launcher's caller)
        group = os.getpgrp() != os.getpgid(pid)
    except OSError:  # already gone: leave alone (its guardian signals the rank's group)
        group = False
    stop = threading.Event()
    threading.Thread(target=_watch, args=(pid, identity, group, period, stop), daemon=True,
                     name=_THREAD).start()
    return stop


def blamed(directory: str) -> dict[str, object] | None:
    """The failed peer that ranks' watchdogs reported in ``directory`` (the earliest), if any."""
    reports = []
    for path in glob.glob(os.path.join(directory, "failure-*.json")):
        try:
            with open(path) as report:
                reports.append((os.path.getmtime(path), json.load(report)))
        except (OSError, ValueError):
            continue
    return min(reports, key=lambda item: item[0])[1] if reports else None


def note_exit(directory: str | None, rank: int, code: int) -> None:
    """The launcher saw ``rank`` end with ``code`` (not 0): its peers' watchdogs read it
    (:func:`exit_of`). A rank that ends by ``sys.exit(3)`` marks itself as left on its way
    out, as a finished rank does, so only the launcher can say it failed."""
    if not directory or not os.path.isdir(directory):
        return
    try:
        with open(os.path.join(directory, f"exited-{rank}.json"), "w") as note:
            json.dump({"rank": rank, "code": code}, note)
    except OSError:
        pass  # (the attempt's folder is gone: the job is over)


def exit_of(directory: str | None, rank: int) -> str | None:
    """How ``rank`` failed, as its launcher saw it (:func:`note_exit`), or None."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, f"exited-{rank}.json")) as note:
            code = int(json.load(note)["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
