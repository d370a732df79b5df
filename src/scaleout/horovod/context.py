"""``hvd.init()`` and who this process is: rank, size, local and cross ranks.

Horovod's API is a set of module-level functions over one job, so the face keeps the job's
state in one :class:`Runtime`, created by :func:`start` and dropped by :func:`shutdown`; every
other module asks for it through :func:`runtime`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.core import collectives as coll
from scaleout.core import watchdog
from scaleout.core.checks import check_seconds
from scaleout.core.collectives import Communicator
from scaleout.core.consistency import control_tensor, verify_plan
from scaleout.core.distribution import Distribution
from scaleout.core.env import DEFAULT_TIMEOUT, Environment, attach
from scaleout.core.env import init as core_init
from scaleout.core.gloo_device import new_group_on_world_device
from scaleout.core.grid import GroupType
from scaleout.horovod.errors import NotInitialized
from scaleout.horovod.launch_vars import horovod_environ, node_key
from scaleout.horovod.process_sets import ProcessSet, global_process_set
from scaleout.horovod.signature import exchange_signature

__all__ = [
    "Runtime", "runtime", "start", "shutdown", "is_initialized", "size", "rank", "local_size",
    "local_rank", "cross_size", "cross_rank", "is_homogeneous", "add_process_set",
    "remove_process_set",
]


@dataclass
class Runtime:
    """The job as the Horovod face sees it (one per process between init and shutdown).

    Attributes:
        env: the scaleout Environment.
        distribution: a data-parallel grid over all ranks (for scaleout's codecs).
        local_rank, local_size, cross_rank, cross_size: Horovod's node-level numbers.
        homogeneous: every node runs the same number of ranks.
        owns_env: ``shutdown()`` finalizes ``env`` (False when attached to a running job).
        process_sets: the registered sets by id (0: the global set).
        names: counters of unnamed calls, per (process set id, collective).
        extras: state other modules keep per job: ``"handles"`` (pending operations),
            ``"timeline"`` (the recording), ``"on_shutdown"`` (callbacks run by shutdown).
    """

    env: Environment
    distribution: Distribution
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    owns_env: bool
    process_sets: dict[int, ProcessSet] = field(default_factory=dict)
    next_set_id: int = 1
    names: dict[tuple[int | None, str], itertools.count] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # handles, timeline: owned by them

    @property
    def comm(self) -> Communicator:
        """The communicator over every rank."""
        return self.distribution.communicator(GroupType.GLOBAL)

    def auto_name(self, kind: str, name: str | None, process_set: ProcessSet) -> str:
        """``name``, or Horovod's ``<kind>.noname.<n>`` for unnamed calls.

        ``n`` counts the unnamed calls of ``kind`` on ``process_set``: only its members run
        them, so a count shared with other sets would drift apart between ranks.
        """
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"{kind}: name must be a string, got {type(name).__name__}")
            return name
        counter = self.names.setdefault((process_set.process_set_id, kind), itertools.count())
        return f"{kind}.noname.{next(counter)}"


_state: list[Runtime] = []  # at most one; a list so that no `global` statement is needed


def runtime() -> Runtime:
    """The running job.

    Raises:
        NotInitialized: ``hvd.init()`` has not been called (or ``hvd.shutdown()`` was).
    """
    if not _state:
        raise NotInitialized("Horovod has not been initialized; use hvd.init().")
    return _state[0]


def _timeout(environ: Mapping[str, str], timeout: float | None,
             default: float = DEFAULT_TIMEOUT) -> float:
    if timeout is not None:
        return timeout
    name = next((n for n in ("HOROVOD_GLOO_TIMEOUT_SECONDS", "SCALEOUT_TIMEOUT")
                 if n in environ), None)
    if name is None:
        return default
    text = environ[name]
    try:
        return check_seconds(float(text), f"environment variable {name}")
    except ValueError as err:
        raise ValueError(f"environment variable {name} must be seconds (> 0, finite, at most "
                         f"a year), got {text!r}") from err


def _node_layout(comm: Communicator, local_rank: int, key: int) -> tuple[int, int, int, int, bool]:
    """(local_rank, local_size, cross_rank, cross_size, homogeneous) from every rank's node."""
    mine = control_tensor(comm, [[key, local_rank]])
    table = coll.allgather(comm, mine).wait().tolist()
    keys = [row[0] for row in table]
    local_size = keys.count(key)
    same_local = [r for r, row in enumerate(table) if row[1] == local_rank]
    per_node = [keys.count(k) for k in dict.fromkeys(keys)]
    return (local_rank, local_size, same_local.index(comm.global_rank), len(same_local),
            len(set(per_node)) == 1)


def start(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None, *,
          timeout: float | None = None, backend: str | None = None) -> None:
    """Join the job and create the Runtime (what :func:`scaleout.horovod.init` does).

    Args and Raises: see :func:`scaleout.horovod.init`.
    """
    if isinstance(process_sets, str):  # (before stop 51, "dynamic" was read as ranks 'd', ...)
        if process_sets != "dynamic":
            raise ValueError(f'process_sets must be a list of ProcessSet or "dynamic", got '
                             f"{process_sets!r}")
        process_sets = None  # sets may be added and removed at any time here
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) takes an MPI communicator; scaleout does "
                                  "not use mpi4py: call hvd.init() and start the job with "
                                  "mpirun, torchrun, srun or `scaleout run`")
    if _state:
        return
    environ = horovod_environ(os.environ)
    owns = not tdist.is_initialized()
    env = core_init(backend, _timeout(environ, timeout), check_consistency=False,
                    environ=environ) if owns else attach()
    if not owns:  # (unless told otherwise, the timeout of the scaleout.init it joins)
        env.timeout = _timeout(environ, timeout, env.timeout)
    distribution = env.create_distribution(env.world_size, 1)
    comm_all = distribution.communicator(GroupType.GLOBAL)
    layout = _node_layout(comm_all, env.local_rank, node_key(environ))
    rt = Runtime(env=env, distribution=distribution, local_rank=layout[0], local_size=layout[1],
                 cross_rank=layout[2], cross_size=layout[3], homogeneous=layout[4], owns_env=owns)
    global_process_set._attach(0, comm_all, list(range(env.world_size)))
    rt.process_sets[0] = global_process_set
    _state.append(rt)
    atexit.register(_at_exit, rt)
    for process_set in process_sets or ():
        add_process_set(process_set)


def _at_exit(rt: Runtime) -> None:
    """Horovod scripts rarely call shutdown(): leave the job at exit, as Horovod does.

    After an uncaught exception the peers may be gone or stuck: tear down without meeting
    them (the launcher stops them); otherwise meet them, as ``shutdown()`` does.
    """
    if not _state or _state[0] is not rt:
        return
    # (a peer's failure caught, then sys.exit: meeting the peers printed it a second time)
    failure = getattr(sys, "last_value", None) or watchdog.failure()
    if failure is None:
        try:
            shutdown()
        except Exception as err:  # (raised in an atexit callback, it was printed and the
            # process ended with code 0, here on a rank that had skipped a collective)
            print(f"scaleout: rank {rt.env.rank}: hvd.shutdown() at exit failed: {err}",
                  file=sys.stderr, flush=True)
            os._exit(1)
        return
    for process_set in rt.process_sets.values():
        process_set._detach()
    _state.clear()
    if rt.owns_env:
        rt.env.__exit__(type(failure), failure, None)  # the Environment's no-meeting exit


def shutdown() -> None:
    """Leave the job (every rank calls it); afterwards ``hvd.init()`` may be called again."""
    if not _state:
        return
    rt = _state[0]
    if rt.comm.size > 1:
        # Horovod's face checks no call below it (init turns the core's check off): a rank
        # that skipped a collective met its peer's signature exchange in finalize, unchecked,
        # and left with exit code 0 while the peer timed out. Now both raise, naming it.
        exchange_signature(rt.comm, "shutdown", "hvd.shutdown",
                           control_tensor(rt.comm, [], dtype=torch.float32))
    for hook in list(rt.extras.get("on_shutdown", [])):
        hook(rt)
    for process_set in rt.process_sets.values():
        process_set._detach()
    _state.clear()
    if rt.owns_env:
        rt.env.finalize()


def is_initialized() -> bool:
    """True between ``hvd.init()`` and ``hvd.shutdown()``."""
    return bool(_state)


def size() -> int:
    """The number of processes in the job."""
    return runtime().env.world_size


def rank() -> int:
    """This process's rank, 0 .. size() - 1."""
    return runtime().env.rank


def local_size() -> int:
    """The number of processes on this node."""
    return runtime().local_size


def local_rank() -> int:
    """This process's rank among the processes of its node."""
    return runtime().local_rank


def cross_size() -> int:
    """The number of processes with this process's local rank (the number of nodes)."""
    return runtime().cross_size


def cross_rank() -> int:
    """This process's rank among the processes with its local rank (its node's index)."""
    return runtime().cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    return runtime().homogeneous


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank calls it with the same ranks, in the same order.

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered set (usable as ``process_set=`` on the members).

    Raises:
        ValueError: the set is already registered, names a rank outside the job, an equal
            set is registered already, or (on every rank) the ranks passed different sets.
    """
    rt = runtime()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is registered already")
    ranks = process_set.ranks if process_set.ranks is not None else list(range(rt.env.world_size))
    # each rank would create a group of the ranks it was given: refuse sets that differ
    verify_plan(rt.comm, "add_process_set", ranks)
    if not ranks or ranks[-1] >= rt.env.world_size:
        raise ValueError(f"a process set needs ranks in 0..{rt.env.world_size - 1}, got {ranks}")
    if any(ps.ranks == ranks for ps in rt.process_sets.values()):
        raise ValueError(f"a process set with ranks {ranks} is registered already")
    group = new_group_on_world_device(ranks)  # every rank takes part in creating it
    set_id = rt.next_set_id
    rt.next_set_id += 1
    member = rt.env.rank in ranks
    comm = Communicator(group=group, ranks=tuple(ranks), name=f"process_set{set_id}",
                        global_rank=rt.env.rank, timeout=rt.env.timeout) if member else None
    process_set._attach(set_id, comm, ranks)
    rt.process_sets[set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank calls it). Returns False if it was not registered.

    Raises:
        ValueError: for the global process set.
    """
    rt = runtime()
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    if process_set.process_set_id not in rt.process_sets:
        return False
    del rt.process_sets[process_set.process_set_id]
    process_set._detach()
    return True
