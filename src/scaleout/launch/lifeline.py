"""A rank dies with its launcher: a parent-death signal, and a parent check as a fallback.

The launcher starts each rank with :func:`die_with_parent` as ``preexec_fn`` (Linux's
``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the rank when the launcher dies, even
with ``kill -9``, even when the rank is stopped or frozen). On systems without ``prctl``, or
when a wrapper (``ip netns exec``, ``setpriv``) clears the signal, :func:`watch_parent`,
started by :func:`scaleout.init`, polls the parent pid and leaves once the launcher is gone.
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

__all__ = ["LAUNCHER_PID_VAR", "REPORT_DIR_VAR", "die_with_parent", "watch_parent", "blamed",
           "note_exit", "exit_of"]

LAUNCHER_PID_VAR = "SCALEOUT_LAUNCHER_PID"
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


def _watch(parent_pid: int, period: float, stop: threading.Event) -> None:
    while not stop.wait(period):
        if os.getppid() != parent_pid:
            sys.stderr.write(f"scaleout: rank pid {os.getpid()}: the launcher (pid {parent_pid}) "
                             "is gone; leaving\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(environ: Mapping[str, str], period: float = 1.0) -> threading.Event | None:
    """Leave (SIGKILL to self) once the launcher named in ``SCALEOUT_LAUNCHER_PID`` is gone.

    Returns:
        An event that stops the watch when set, or ``None`` when this process was not
        started by ``scaleout run`` (or its parent is not the launcher, as under a wrapper),
        or a watch already runs.
    """
    value = environ.get(LAUNCHER_PID_VAR, "")
    if not value.isdigit() or int(value) != os.getppid():
        return None
    if any(thread.name == _THREAD for thread in threading.enumerate()):
        return None
    stop = threading.Event()
    threading.Thread(target=_watch, args=(int(value), period, stop), daemon=True,
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
