"""How many collectives this process has started on each group: what a timed-out rank reads
from its peers' heartbeats to name the one that never came.

A collective waits for every member of its group. When one member is alive (its heartbeat
goes on) but busy or blocked outside communication (a loop in Python, a data loader that
hangs, a lock), its peers' waits time out, and the watchdog sees nothing wrong. Each rank
counts the collectives it starts per group (:func:`started`, called by
``scaleout.core.communicator.Communicator.request``: a dictionary update, no I/O) and its watchdog
publishes the counts with every heartbeat (:func:`snapshot`). A rank whose wait times out
compares its own count on the group with each member's last published one: a member that has
started fewer has not reached the call (``scaleout.core.peer_waits.lagging``).

Counts are per group *label* (``data[0, 1]``): every member of a group makes the same calls in
the same order, so equal labels count alike on every rank.

A heartbeat also says whether the rank is in ``finalize()`` and whether anything of this
process may still start a collective there (a progress engine with work queued or in flight:
:func:`register_busy`): a rank in ``finalize()`` with nothing in progress starts no collective
again, so a peer waiting in a call it never started waits for good
(``scaleout.core.diverged``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

__all__ = ["started", "refused", "snapshot", "count", "lagging", "finalizing",
           "register_busy"]

_lock = threading.Lock()
_calls: dict[str, list] = {}  # label -> [count, last operation, member ranks]
_latest: list[str] = []  # [label, operation] of the latest collective started
_refused: dict[str, list] = {}  # label -> [collectives started there by then, the refusal]
_finalizing = [False]  # this process is in finalize(): its main thread starts nothing more
_busy: list[weakref.WeakMethod] = []  # bound methods: True while more may start


def finalizing(now: bool = True) -> None:
    """Note that this process entered ``finalize()`` (its last collective call), or, with
    ``now=False``, that a job begins (``init()``)."""
    _finalizing[0] = now


def register_busy(method: Callable[[], bool]) -> None:
    """Have heartbeats ask ``method`` (a bound method, held weakly) whether something of
    this process may still start collectives on its own (a progress engine's thread)."""
    with _lock:
        _busy[:] = [ref for ref in _busy if ref() is not None]
        _busy.append(weakref.WeakMethod(method))  # type: ignore[arg-type]


def _busy_now() -> bool:
    with _lock:
        methods = [ref() for ref in _busy]
    return any(method is not None and method() for method in methods)


def started(label: str, operation: str, members: tuple[int, ...]) -> None:
    """Note that this process started ``operation`` on the group ``label`` of ``members``."""
    with _lock:
        entry = _calls.get(label)
        if entry is None:
            _calls[label] = [1, operation, members]
        else:
            entry[0] += 1
            entry[1] = operation
        _latest[:] = [label, operation]


def refused(label: str, why: str) -> None:
    """Note that this process refused a collective's arguments on the group ``label`` (its
    peers may wait in that call: their timeouts say why it never came)."""
    with _lock:
        entry = _calls.get(label)
        _refused[label] = [0 if entry is None else entry[0], why]


def snapshot() -> dict[str, object]:
    """What a heartbeat publishes: ``{"calls": {label: [count, last operation]}, "latest":
    [label, operation], "refused": {label: [count then, why]}, "finalizing": bool, "busy":
    bool}`` (``latest`` empty before the first collective)."""
    busy = _busy_now()
    with _lock:
        return {"calls": {label: [n, op] for label, (n, op, _) in _calls.items()},
                "latest": list(_latest), "refused": {k: list(v) for k, v in _refused.items()},
                "finalizing": _finalizing[0], "busy": busy}


def count(label: str) -> tuple[int, tuple[int, ...]] | None:
    """(collectives started on ``label``, its member ranks), or None if none was."""
    with _lock:
        entry = _calls.get(label)
        return None if entry is None else (entry[0], entry[2])


def lagging(group: str, me: int, calls_of: Callable[[int], dict]) -> str | None:
    """A sentence naming the members of ``group`` that have started fewer collectives on it
    than this rank (``me``), or None when none has (or this rank started none there).

    Args:
        group: the group's label.
        me: this rank (global).
        calls_of: a member's last published :func:`snapshot` (``{}`` when it has none).
    """
    mine = count(group)
    if mine is None:
        return None
    total, members = mine
    behind, astray = [], []
    with _lock:
        my_last = _calls[group][1]
    for rank in members:
        if rank != me:
            published = calls_of(rank)
            theirs, last = published.get("calls", {}).get(group, [0, None])
            if theirs > total or (theirs == total and last is not None and last != my_last):
                astray.append((rank, f"rank {rank}: {theirs} (last: {last})"))
            elif theirs < total:
                said = f"rank {rank}: {theirs}" + (f" (last: {last})" if last else "")
                latest = published.get("latest") or [group]
                if latest[0] != group:
                    said += f", its latest call {latest[1]} on group {latest[0]}"
                then, why = published.get("refused", {}).get(group, [None, ""])
                if then == theirs:  # (no call started there since)
                    said += f"; it refused the arguments of its next call on this group: {why}"
                behind.append((rank, said))
    if astray and not behind:  # (before: a timeout that named nobody)
        many = len(astray) > 1
        return (f"rank{'s' if many else ''} {', '.join(str(rank) for rank, _ in astray)} "
                f"{'are' if many else 'is'} at another collective on this group: collectives "
                f"started on it by the last heartbeat: this rank: {total} (last: {my_last}), "
                f"{', '.join(text for _, text in astray)}; the ranks took different code paths "
                "(by default a call new to one rank is not checked against one the other made "
                "before; SCALEOUT_CHECK=1 checks every call)")
    if not behind:
        return None
    many = len(behind) > 1
    return (f"rank{'s' if many else ''} {', '.join(str(rank) for rank, _ in behind)} "
            f"{'are' if many else 'is'} alive but not at this call: collectives started on "
            f"this group by the last heartbeat: this rank: {total}, "
            f"{', '.join(text for _, text in behind)}; {'they are' if many else 'it is'} busy "
            "or blocked outside scaleout's collectives, or waiting in another one")
