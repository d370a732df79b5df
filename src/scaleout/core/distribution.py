"""MLSL's data x model process grid and the collectives that run on its groups."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from scaleout.core import collectives as coll
from scaleout.core.collectives import Communicator, ReduceOp
from scaleout.core.consistency import verify_plan
from scaleout.core.gloo_device import new_group_on_world_device
from scaleout.core.grid import Grid, GroupType
from scaleout.core.request import Request

__all__ = ["Distribution", "Member"]


class Member(Protocol):
    """What a Distribution needs of its Environment (kept abstract: no import cycle)."""

    rank: int
    world_size: int
    timeout: float
    check_consistency: bool | str

    def require_alive(self) -> None: ...


class Distribution:
    """A data x model grid of ranks with non-blocking collectives on its groups.

    Create one with :meth:`Environment.create_distribution` (every rank must call it, in the
    same order, since it creates process groups). Every collective takes ``group=`` and
    returns a :class:`~scaleout.core.request.Request`; ``wait()`` gives the result tensor.

    Example (2 ranks):
        >>> d = env.create_distribution(2, 1)
        >>> t = torch.full((2,), float(env.rank))
        >>> d.allreduce(t, group=GroupType.DATA).wait()
        tensor([1., 1.])
    """

    def __init__(self, env: Member, grid: Grid) -> None:
        if not isinstance(grid, Grid):
            raise TypeError(f"grid must be a scaleout Grid, got {type(grid).__name__}")
        if grid.world_size != env.world_size:
            raise ValueError(f"the grid is for {grid.world_size} ranks, the job has "
                             f"{env.world_size}")
        if env.world_size > 1:  # ranks on different grids would each run a collective alone
            world = Communicator(group=tdist.group.WORLD, ranks=tuple(range(env.world_size)),
                                 name="global", global_rank=env.rank, timeout=env.timeout,
                                 check_consistency="off")
            verify_plan(world, "create_distribution", grid)
        layout = grid.groups()
        self._env = env
        self.grid = grid
        self.data_parts = grid.data_parts
        self.model_parts = grid.model_parts
        self._comms: dict[GroupType, Communicator] = {}
        self._spare: dict[tuple[GroupType, str], list[Communicator]] = {}  # (reuse)
        # handed back and never taken again: freed with this distribution (not at exit)
        weakref.finalize(self, _free_spares, self._spare).atexit = False
        for group_type in GroupType:  # every rank creates every group in the same order
            for ranks in layout[group_type]:
                # a group of one rank (the model group of a data-parallel grid) needs no
                # process group: its collectives complete at once without one (see
                # communicator._start), and each gloo group keeps a thread that wakes 100
                # times a second; the layout is the same on every rank, so all skip alike
                group = (None if len(ranks) == 1 and env.world_size > 1
                         else self._new_group(ranks))
                if env.rank in ranks:
                    self._comms[group_type] = Communicator(
                        group=group, ranks=ranks, name=group_type.value, global_rank=env.rank,
                        timeout=env.timeout, check_consistency=env.check_consistency,
                    )

    def duplicate(self, group: GroupType, name: str) -> Communicator:
        """A new communicator over the same ranks as ``group``, on its own process groups.

        Collectives on different communicators never queue behind one another inside the
        communication library. Every rank must call this, in the same order.

        Duplicates check consistency only in ``"full"`` mode: they carry a scheduler's
        lanes, whose calls interleave in a timing-dependent order across communicators, so
        the blocking first-call check (``"first"``) could deadlock them; their plans are
        checked once with :func:`~scaleout.core.collectives.verify_plan`.

        One handed back with :meth:`reuse` under the same group and name is taken again
        instead of a new process group.
        """
        self._env.require_alive()
        spare = self._spare.get((group, name))
        if spare:
            return spare.pop()
        layout = self.grid.groups()
        mine = None
        for ranks in layout[group]:
            created = self._new_group(ranks, fresh=True)
            if self._env.rank in ranks:
                check = "full" if self._env.check_consistency in ("full", True) else "off"
                mine = Communicator(group=created, ranks=ranks, name=name,
                                    global_rank=self._env.rank, timeout=self._env.timeout,
                                    check_consistency=check)
        assert mine is not None
        return mine

    def reuse(self, group: GroupType, comm: Communicator) -> None:
        """Hand back ``comm``, a :meth:`duplicate` of ``group`` whose user is done with it and
        has nothing in flight on it: the next duplicate of the same group and name takes it.

        A process group is never freed, and each gloo group keeps a thread that wakes 100
        times a second; a session planned again (the autotuner's trials) would otherwise
        leave its lanes' groups behind each time. Every rank must hand back and duplicate in
        the same order, as it duplicated.
        """
        self._spare.setdefault((group, comm.name), []).append(comm)

    def release(self, comm: Communicator) -> None:
        """Free ``comm``'s process group, a :meth:`duplicate` whose user is done with it and
        has nothing in flight on it (a closed session's lanes, a closed model's buffers):
        its connections and worker threads go with the last reference to ``comm``. Local:
        no rank waits for another.

        Since stop 52: a closed model's groups were never freed, so a sweep that builds
        and closes a model per trial kept one more socket per peer and two gloo threads
        per trial (50 trials, 2 ranks: +50 descriptors, +100 threads in every rank).
        """
        _free(comm)

    def _new_group(self, ranks: tuple[int, ...], fresh: bool = False) -> Any:
        if len(ranks) == self._env.world_size and not fresh:
            return tdist.group.WORLD
        return new_group_on_world_device(list(ranks))

    @property
    def env(self) -> Any:
        """The Environment this distribution belongs to."""
        return self._env

    def communicator(self, group: GroupType) -> Communicator:
        """The communicator of ``group`` that contains this rank."""
        self._env.require_alive()
        if not isinstance(group, GroupType):
            raise TypeError(f"group must be a scaleout.GroupType, got {group!r}")
        return self._comms[group]

    def rank(self, group: GroupType) -> int:
        """This process's rank within ``group``."""
        return self.communicator(group).rank

    def size(self, group: GroupType) -> int:
        """The number of ranks in ``group``."""
        return self.communicator(group).size

    def ranks(self, group: GroupType) -> tuple[int, ...]:
        """The global ranks of ``group``'s members, in group-rank order."""
        return self.communicator(group).ranks

    def process_group(self, group: GroupType) -> Any:
        """The underlying torch.distributed process group (for interoperation)."""
        return self.communicator(group).group

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                  group: GroupType) -> Request:
        """Reduce ``tensor`` in place on every rank of ``group``."""
        return coll.allreduce(self.communicator(group), tensor, op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp = ReduceOp.SUM, *,
               group: GroupType) -> Request:
        """Reduce ``tensor`` onto group rank ``root``."""
        return coll.reduce(self.communicator(group), tensor, root, op)

    def bcast(self, tensor: torch.Tensor, root: int, *, group: GroupType) -> Request:
        """Broadcast group rank ``root``'s ``tensor`` in place."""
        return coll.bcast(self.communicator(group), tensor, root)

    def allgather(self, tensor: torch.Tensor, *, group: GroupType,
                  out: torch.Tensor | None = None) -> Request:
        """Concatenate every rank's ``tensor`` along dim 0 on every rank (into ``out``)."""
        return coll.allgather(self.communicator(group), tensor, out)

    def allgatherv(self, tensor: torch.Tensor, counts: Sequence[int], *,
                   group: GroupType) -> Request:
        """Concatenate ``counts[i]`` rows from each rank i along dim 0 on every rank."""
        return coll.allgatherv(self.communicator(group), tensor, counts)

    def gather(self, tensor: torch.Tensor, root: int, *, group: GroupType) -> Request:
        """Concatenate every rank's ``tensor`` on ``root`` (``None`` elsewhere)."""
        return coll.gather(self.communicator(group), tensor, root)

    def scatter(self, tensor: torch.Tensor, root: int, *, group: GroupType,
                out: torch.Tensor | None = None) -> Request:
        """Give rank i the i-th equal row block of ``root``'s ``tensor`` (into ``out``)."""
        return coll.scatter(self.communicator(group), tensor, root, out)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                       group: GroupType, out: torch.Tensor | None = None) -> Request:
        """Reduce ``tensor``; rank i receives the i-th equal row block (into ``out``)."""
        return coll.reduce_scatter(self.communicator(group), tensor, op, out)

    def alltoall(self, tensor: torch.Tensor, *, group: GroupType,
                 out: torch.Tensor | None = None) -> Request:
        """Send row block j to rank j; block i of the result came from rank i (into ``out``)."""
        return coll.alltoall(self.communicator(group), tensor, out)

    def alltoallv(self, tensor: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int], *, group: GroupType,
                  out: torch.Tensor | None = None) -> Request:
        """All-to-all with per-rank row counts (into ``out``)."""
        return coll.alltoallv(self.communicator(group), tensor, send_counts, recv_counts, out)

    def barrier(self, *, group: GroupType, timeout: float | None = None) -> None:
        """Block until every rank of ``group`` arrives."""
        coll.barrier(self.communicator(group), timeout)

    def __repr__(self) -> str:
        return (f"<Distribution data_parts={self.data_parts} model_parts={self.model_parts} "
                f"rank={self._env.rank}>")


def _free(comm: Communicator) -> None:
    """:meth:`Distribution.release`'s work: destroy ``comm``'s process group if torch still
    has it (not WORLD; nothing after ``finalize()``)."""
    group = comm.group
    if group is None or not tdist.is_initialized() or group is tdist.group.WORLD:
        return
    if group in tdist.distributed_c10d._world.pg_map:  # (torch's registry lets it go;
        tdist.destroy_process_group(group)  # it is freed with its last communicator)


def _free_spares(spare: dict[Any, list[Communicator]]) -> None:
    """Free the communicators a collected distribution still held for :meth:`reuse`: no one
    can take them again (since stop 52: a model tuned by ``tune=`` left its old plan's unused
    lanes there, one gloo group, a socket and two threads per dropped model)."""
    comms = [comm for kept in spare.values() for comm in kept]
    spare.clear()
    for comm in comms:
        _free(comm)
