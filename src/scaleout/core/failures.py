"""What the watchdog (:mod:`scaleout.core.watchdog`) knows of a failed peer: the
:class:`PeerFailure` it reports, the ``SCALEOUT_HEARTBEAT`` setting, and what ``/proc``
says of a process on this machine."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from scaleout.core.checks import check_seconds
from scaleout.core.errors import CommunicationError
from scaleout.launch.environment import proc_stat

__all__ = ["HEARTBEAT_VAR", "DEFAULT_LIMIT", "MIN_LIMIT", "DEPARTED", "PeerFailure",
           "heartbeat_limit", "process_state", "StoreHostDown", "first_line",
           "broken_by_communication"]

HEARTBEAT_VAR = "SCALEOUT_HEARTBEAT"
DEFAULT_LIMIT = 15.0
MIN_LIMIT = 0.5  # seconds: 0.1 s beats and slack for a loaded machine
DEPARTED = "exited without finalize() while the others were still communicating"


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
        what = self.reason if self.reason.startswith(f"rank {self.rank} ") else \
            f"rank {self.rank} failed: {self.reason}"
        return (f"{what} (noticed by rank {self.detected_by}, "
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


#: A process seen stopped must stay stopped this long (``/proc`` read every
#: :data:`STOP_POLL_S`) to be reported: a sampling profiler (``py-spy record``, ``py-spy
#: dump``) or ``strace`` stops its target for a moment at a time (``t``), and one unlucky read
#: named a live rank as failed and ended the job (stop 46). A rank frozen for good (SIGSTOP,
#: a debugger holding it) is still named within a period.
STOP_CONFIRM_S = 0.25
STOP_POLL_S = 0.005
_STATES = {"T": "process stopped (SIGSTOP)", "t": "process stopped (traced)",
           "Z": "process exited", "X": "process exited"}
_STOPPED = frozenset("Tt")


def process_state(pid: int, confirm_s: float = STOP_CONFIRM_S) -> str | None:
    """Why process ``pid`` (on this machine) cannot answer, or None if it runs. Exited is
    final; stopped only when ``/proc`` says so for ``confirm_s`` seconds on end."""
    fields = proc_stat(pid)
    if not fields:
        return "process exited"
    until = time.monotonic() + confirm_s
    while fields[0] in _STOPPED and time.monotonic() < until:  # (stopped for a moment?)
        time.sleep(STOP_POLL_S)
        fields = proc_stat(pid)
        if not fields:
            return "process exited"
    return _STATES.get(fields[0])


class StoreHostDown(Exception):
    """The store's host process is gone or stopped (seen in ``/proc``): its store would fail
    or block for good, so the watchdog does not touch it."""


def first_line(err: BaseException) -> str:
    """The first line of an error's text (or its type's name)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def broken_by_communication(error: BaseException | None) -> bool:
    """Whether ``error`` is (or was raised from) a CommunicationError (a collective that
    failed or timed out, its work maybe still pending in gloo) or the consistency check's
    ValueError (the ranks called different collectives): gloo may abort in the teardown."""
    for _ in range(16):  # (a chain of causes; bounded, a cycle is possible)
        if error is None:
            return False
        if isinstance(error, CommunicationError) or getattr(error, "collective_mismatch", False):
            return True
        error = error.__cause__ or error.__context__
    return False
