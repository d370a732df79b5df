"""Horovod's handles: what ``*_async`` returns, ``synchronize(handle)`` and ``poll(handle)``.

A handle is an int naming a pending operation: the core requests it waits on and the step
that turns their results into Horovod's output (divide for Average, decompress, ...).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scaleout.horovod.context import Runtime, runtime
from scaleout.horovod.timeline import record_span

__all__ = ["submit", "synchronize", "poll", "Pending", "require_idle", "Key"]

#: what identifies a tensor in flight: (process set id, collective, name)
Key = tuple[Any, str, str]


@dataclass
class Pending:
    """One submitted operation.

    Attributes:
        kind, name: the collective and the tensor name (for the timeline).
        requests: objects with ``wait(timeout)`` and ``test()`` (core requests and the like).
        finish: turns the requests' results into the operation's output.
        keys: what :func:`require_idle` returned for each tensor of the operation: busy
            until ``synchronize``.
    """

    kind: str
    name: str
    requests: Sequence[Any]
    finish: Callable[[list[Any]], Any]
    keys: tuple[Key, ...] = ()
    started: float = field(default_factory=time.perf_counter)


@dataclass
class _Table:
    pending: dict[int, Pending] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    busy: set[Key] = field(default_factory=set)


def _table(rt: Runtime) -> _Table:
    return rt.extras.setdefault("handles", _Table())


def submit(rt: Runtime, pending: Pending) -> int:
    """Register ``pending`` and return its handle."""
    table = _table(rt)
    handle = next(table.ids)
    table.pending[handle] = pending
    table.busy.update(pending.keys)
    return handle


def require_idle(rt: Runtime, process_set_id: int | None, kind: str, name: str) -> Key:
    """The key of a ``kind`` call named ``name`` about to start on a process set.

    Raises:
        ValueError: a call with that key was submitted and not yet synchronized: as in
            Horovod, a name stands for one tensor at a time (two in flight could pair with
            the other ranks' in either order; before stop 51 they were paired in submission
            order, silently mixing tensors when ranks submitted them in different orders).
    """
    key = (process_set_id, kind, name)
    if key in _table(rt).busy:
        raise ValueError(f"{kind}: another {kind} named {name!r} is still in flight on this "
                         "process set (submitted, not yet synchronized); a name stands for one "
                         "tensor at a time, as in Horovod: synchronize that one first, or pass "
                         "another name=")
    return key


def _find(handle: object, operation: str) -> tuple[Runtime, Pending | None]:
    rt = runtime()
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(f"{operation}: handle must be an int from an *_async call, "
                        f"got {type(handle).__name__}")
    return rt, _table(rt).pending.get(handle)


def poll(handle: int) -> bool:
    """True when the operation of ``handle`` has completed (``synchronize`` then returns at once).

    Raises:
        TypeError: the handle is not an int.
        ValueError: the handle is unknown or already synchronized (as Horovod's "Handle N was
            not created or has been cleared").
        CommunicationError: the operation failed (names rank, group and operation).
    """
    _rt, pending = _find(handle, "poll")
    if pending is None:
        raise ValueError(f"poll: handle {handle} was not created or has been cleared (already "
                         "synchronized, or not returned by an *_async call of this job)")
    return all(request.test() for request in pending.requests)


def synchronize(handle: int, timeout: float | None = None) -> Any:
    """Wait for the operation of ``handle`` and return its output.

    Args:
        handle: what an ``*_async`` call returned.
        timeout: seconds to wait at most (default: the job's timeout).

    Returns:
        The output tensor (a list for grouped operations; a tuple for alltoall with splits);
        ``None`` for a handle already synchronized (or never returned), as in Horovod (before
        stop 52: a ValueError).

    Raises:
        TypeError: the handle is not an int.
        CommunicationTimeout: not complete within the timeout (names rank, group, operation).
        CommunicationError: the operation failed.
    """
    rt, pending = _find(handle, "synchronize")
    if pending is None:
        return None
    try:
        results = [request.wait(timeout) for request in pending.requests]
        output = pending.finish(results)
    finally:
        del _table(rt).pending[handle]
        _table(rt).busy.difference_update(pending.keys)
    record_span(rt, pending.kind, pending.name, pending.started, time.perf_counter())
    return output
