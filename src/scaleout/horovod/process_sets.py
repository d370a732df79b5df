"""Horovod's process sets: collectives over a subset of the ranks.

A :class:`ProcessSet` names ranks; it becomes usable once registered, by ``hvd.init(
process_sets=[...])`` or :func:`scaleout.horovod.add_process_set` (every rank calls it, in the
same order, as torch.distributed creates one process group per set).
"""

from __future__ import annotations

from collections.abc import Iterable

from scaleout.core.collectives import Communicator
from scaleout.horovod.errors import NotInitialized

__all__ = ["ProcessSet", "global_process_set", "root_index"]


class ProcessSet:
    """A set of global ranks that run collectives among themselves.

    Args:
        ranks: the global ranks of the members (any order; kept sorted, as Horovod does).

    Raises:
        TypeError: ``ranks`` is not an iterable of ints.
        ValueError: duplicate or negative ranks.

    Example (4 ranks):
        >>> evens = hvd.add_process_set(hvd.ProcessSet([0, 2]))
        >>> hvd.allreduce(t, process_set=evens)      # on ranks 0 and 2 only
    """

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        if ranks is None:
            self.ranks: list[int] | None = None  # the global set: every rank
        else:
            values = list(ranks)
            if any(isinstance(r, bool) or not isinstance(r, int) for r in values):
                raise TypeError(f"ProcessSet ranks must be ints, got {values!r}")
            if len(set(values)) != len(values) or any(r < 0 for r in values):
                raise ValueError(f"ProcessSet ranks must be distinct ranks >= 0, got {values}")
            self.ranks = sorted(values)
        self.process_set_id: int | None = None
        self._comm: Communicator | None = None
        self._member = False

    def _attach(self, set_id: int, comm: Communicator | None, ranks: list[int]) -> None:
        self.process_set_id = set_id
        self.ranks = ranks
        self._comm = comm
        self._member = comm is not None

    def _detach(self) -> None:
        self.process_set_id = None
        self._comm = None
        self._member = False

    def require_registered(self, operation: str) -> None:
        """Raise unless the set is registered.

        Raises:
            NotInitialized: the set is not registered (or Horovod is not initialised).
        """
        if self.process_set_id is None:
            raise NotInitialized(
                f"{operation}: process set {self.ranks} is not registered: call hvd.init() "
                "(for the global set) or hvd.add_process_set() on every rank first")

    def communicator(self, operation: str) -> Communicator:
        """The communicator to run ``operation`` on.

        Raises:
            NotInitialized: the set is not registered (or Horovod is not initialised).
            ValueError: this rank is not a member of the set.
        """
        self.require_registered(operation)
        if self._comm is None:
            raise ValueError(f"{operation}: this rank is not a member of process set "
                             f"{self.process_set_id} (ranks {self.ranks})")
        return self._comm

    def included(self) -> bool:
        """True when this rank is a member (False before registration)."""
        return self._member

    def size(self) -> int:
        """The number of ranks in the set."""
        return self.communicator("size").size

    def rank(self) -> int:
        """This rank's index within the set."""
        return self.communicator("rank").rank

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: Every rank of the job; registered by ``hvd.init()``.
global_process_set = ProcessSet()


def root_index(comm: Communicator, root_rank: object, operation: str) -> int:
    """The group index of global rank ``root_rank``; raise unless it is a member."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"{operation}: root_rank must be an int, got {type(root_rank).__name__}")
    if root_rank not in comm.ranks:
        raise ValueError(f"{operation}: root_rank must be a rank of the process set "
                         f"{list(comm.ranks)}, got {root_rank}")
    return comm.ranks.index(root_rank)
