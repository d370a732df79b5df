"""A communicator: one group of ranks as seen from one member, the reductions, and how a
collective is started on it (with the one-member shortcut)."""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.core import progress
from scaleout.core.errors import CommunicationError
from scaleout.core.request import Request, WorkRequest

__all__ = ["CHECK_MODES", "ReduceOp", "Communicator", "all_gather_single", "release_groups",
           "reduce_scatter_single"]


CHECK_MODES = ("off", "first", "full")


class ReduceOp(enum.Enum):
    """Reductions. ``AVG`` is a sum divided by the group size (floating dtypes only)."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


# torch >= 2.10 names these *_single (the *_tensor names warn); older releases lack them.
all_gather_single = getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)

_TORCH_OPS = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.AVG: tdist.ReduceOp.SUM,  # divided by the size when the request finishes
}


@dataclass(frozen=True, kw_only=True)
class Communicator:
    """One group of ranks as seen from one member.

    Attributes:
        group: the torch.distributed process group.
        ranks: the global ranks of the members, in group-rank order.
        name: the group's name in error messages (``"data"``, ``"model"``, ``"global"``).
        global_rank: this process's global rank.
        timeout: default seconds a wait may block.
        check_consistency: verify that every member called the same operation with the same
            dtype, shape, reduce op and root (one small extra exchange per checked call):
            ``"full"`` before every call, ``"first"`` the first time each distinct call
            occurs on this communicator (a training loop's repeated calls cost nothing after
            the first iteration), ``"off"``; ``True``/``False`` mean ``"full"``/``"off"``.
    """

    group: Any
    ranks: tuple[int, ...]
    name: str
    global_rank: int
    timeout: float
    check_consistency: bool | str = "off"
    _seen: set[str] = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        mode = {True: "full", False: "off"}.get(self.check_consistency, self.check_consistency)
        if mode not in CHECK_MODES:
            raise ValueError(f"check_consistency must be one of {CHECK_MODES} or a bool, got "
                             f"{self.check_consistency!r}")
        object.__setattr__(self, "check_consistency", mode)
        if self.group is not None:
            _LIVE[id(self)] = self

    def needs_check(self, description: str) -> bool:
        """Whether a call described so must be verified across ranks now (and remember it)."""
        if self.check_consistency == "full":
            return True
        if self.check_consistency == "off" or description in self._seen:
            return False
        self._seen.add(description)
        return True

    def would_check(self, description: str) -> bool:
        """Whether :meth:`needs_check` would say so now (remembering nothing)."""
        return self.check_consistency == "full" or (
            self.check_consistency == "first" and description not in self._seen)

    def forget(self, description: str) -> None:
        """Drop a call the ranks did not agree on from the remembered ones."""
        self._seen.discard(description)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    def request(self, operation: str, works: Sequence[Any], finish: Callable[[], Any],
                nbytes: int = 0) -> Request:
        """The request of a collective just started (counted for ``progress.lagging``)."""
        if self.size > 1:
            progress.started(self.label, operation, self.ranks)
        return WorkRequest(works, finish, rank=self.global_rank, group=self.label,
                           operation=operation, timeout=self.timeout, nbytes=nbytes)

    @property
    def label(self) -> str:
        return f"{self.name}{list(self.ranks)}"

    @classmethod
    def of_group(cls, group: Any = None, *, name: str = "group",
                 timeout: float = 300.0) -> Communicator:
        """The communicator of a plain torch.distributed process group (``None``: the
        default group), for code outside a scaleout Distribution (torch's DDP hooks, say)."""
        ranks = tuple(tdist.get_process_group_ranks(group or tdist.group.WORLD))
        return cls(group=group, ranks=ranks, name=name, global_rank=tdist.get_rank(),
                   timeout=timeout)

    @classmethod
    def alone(cls, *, timeout: float = 300.0) -> Communicator:
        """A group of this process alone: every collective completes at once, with no
        process group and on any device (to run a codec's exchange by itself)."""
        return cls(group=None, ranks=(0,), name="alone", global_rank=0, timeout=timeout)


#: every communicator holding a process group, until it is collected (see release_groups)
_LIVE: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()


def release_groups() -> None:
    """Drop every communicator's process group (at ``finalize()``, after torch's groups were
    destroyed), so that the groups are freed now, on this thread, not while the interpreter
    shuts down: freed then, a gloo group made a rank abort after a correct run ("terminate
    called without an active exception", 2 of 30 two-rank runs under load)."""
    for comm in list(_LIVE.values()):
        object.__setattr__(comm, "group", None)  # (the last reference: freed here)
    _LIVE.clear()


class _LocalWork:
    """What a collective on a group of one returns: done at once, no library call (so a
    one-rank group needs no process group at all, and any device, ``meta`` too, works)."""

    def __init__(self) -> None:
        self._future = torch.futures.Future()
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> Any:
        return self._future


def _start(comm: Communicator, operation: str, start: Callable[[], Any],
           local: Callable[[], Any] = lambda: None) -> Any:
    """Start a collective; on a group of one, ``local()`` gives its result instead (for
    in-place collectives the input already is the result)."""
    if comm.size == 1:
        local()
        return _LocalWork()
    try:
        return start()
    except (RuntimeError, ValueError) as err:
        raise CommunicationError(
            f"rank {comm.global_rank}: {operation} on group {comm.label} could not start: {err}",
            rank=comm.global_rank, group=comm.label, operation=operation,
        ) from err
