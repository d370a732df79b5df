"""The Environment: who this process is, which backend, timeouts; init and finalize."""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import os
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING
from datetime import timedelta

import torch
import torch.distributed as tdist

from scaleout.core import progress, watchdog
from scaleout.core.backend import _backend_names, choose_backend, local_world_size
from scaleout.core.checks import check_seconds
from scaleout.core.collectives import CHECK_MODES, Communicator, barrier
from scaleout.core.communicator import release_groups
from scaleout.core.distribution import Distribution
from scaleout.core.grid import Grid
from scaleout.core.errors import NotInitializedError, ScaleoutError
from scaleout.launch.environment import TESTBED_HOST_VAR, LaunchInfo, detect_launch
from scaleout.launch.lifeline import watch_parent
from scaleout.launch.restarts import restart_count
from scaleout.launch.secret import TOKEN_VAR, job_token

if TYPE_CHECKING:
    from scaleout.launch.rendezvous import Rendezvous

__all__ = ["Environment", "init", "attach", "choose_backend", "check_settings", "local_world_size",
           "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
#: seconds the teardown at interpreter exit may take (see :func:`_leave_at_exit`)
EXIT_TEARDOWN_S = 10.0
#: Environments made by :func:`init` and not finalized: torn down at interpreter exit
_open: list[Environment] = []


def check_settings(environ: Mapping[str, str]) -> None:
    """The settings every rank reads at :func:`init` (``SCALEOUT_CHECK``,
    ``SCALEOUT_HEARTBEAT``, the names in ``SCALEOUT_BACKEND``), checked where the ranks are
    launched, so that a bad one is one error there, not a traceback on every rank.

    Raises:
        ValueError: a setting that :func:`init` would refuse.
    """
    _check_mode(None, environ)
    watchdog.heartbeat_limit(environ)
    if environ.get("SCALEOUT_BACKEND", "").strip():
        _backend_names(environ["SCALEOUT_BACKEND"].strip(), "SCALEOUT_BACKEND")


class Environment:
    """This process's place in the job. Made by :func:`scaleout.init`.

    Attributes:
        rank, world_size, local_rank: as launched.
        backend: the torch.distributed backend string.
        device: this rank's default device (``cuda:N`` where a GPU is visible, else the CPU);
            with NCCL it is also made the current CUDA device.
        timeout: seconds any collective may wait before raising.
        check_consistency: ``"full"``, ``"first"`` or ``"off"``: when to verify that every rank
            called the same collective (see :class:`~scaleout.core.collectives.Communicator`).
        rendezvous: the job's authenticated store (``None`` for one process or when attached).
    """

    def __init__(self, info: LaunchInfo, backend: str, timeout: float,
                 check_consistency: bool | str, device: torch.device | None = None,
                 rendezvous: Rendezvous | None = None) -> None:
        self._info = info
        self.rendezvous = rendezvous
        self.backend = backend
        self.device = torch.device("cpu") if device is None else device
        self.timeout = timeout
        self.check_consistency = check_consistency
        self._alive = True

    @property
    def rank(self) -> int:
        return self._info.rank

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def local_rank(self) -> int:
        return self._info.local_rank

    @property
    def launch(self) -> LaunchInfo:
        """How this process was launched (rendezvous address and which convention)."""
        return self._info

    def require_alive(self) -> None:
        """Raise :class:`NotInitializedError` if ``finalize()`` was called."""
        if not self._alive:
            raise NotInitializedError(
                f"rank {self.rank}: the scaleout Environment was finalized; call scaleout.init() "
                "again to communicate"
            )

    def create_distribution(self, data_parts: int | None = None, model_parts: int = 1) -> Distribution:
        """A data x model grid (see :class:`~scaleout.core.distribution.Distribution`).

        Args:
            data_parts: data-parallel degree; ``None`` or ``-1`` means world_size / model_parts.
            model_parts: model-parallel degree (consecutive ranks).

        Raises:
            ValueError: ``data_parts * model_parts`` does not divide the world size, or the
                ranks asked for different grids (every rank's is named).
        """
        self.require_alive()
        grid = Grid(world_size=self.world_size, model_parts=model_parts,
                    data_parts=-1 if data_parts is None else data_parts)
        return Distribution(self, grid)

    def finalize(self) -> None:
        """Tear down torch.distributed. The Environment cannot be used afterwards.

        Every rank must call it: the ranks first meet in a barrier (bounded by the
        environment's timeout), because a rank that tears gloo down while a peer still
        exchanges with it can make that peer abort at exit ("terminate called without an
        active exception", 6 of 30 three-rank runs of a one-allreduce script without it).
        That barrier is a scaleout collective on the global group, watched and checked like
        any other: a peer that fails meanwhile is a PeerFailedError naming it, a peer still
        in another collective a ValueError naming both calls (``"full"`` checks; ``"first"``
        only when that call is the first of its kind on its communicator).

        Raises:
            PeerFailedError, CommunicationTimeout, ValueError: the barrier failed (this rank
                is then not torn down: leave the process).
        """
        self._teardown(meet=True)

    def _teardown(self, *, meet: bool) -> None:
        self.require_alive()
        self._alive = False
        if self in _open:
            _open.remove(self)
        if meet and self.world_size > 1 and tdist.is_initialized():
            comm = Communicator(group=tdist.group.WORLD, ranks=tuple(range(self.world_size)),
                                name="global", global_rank=self.rank, timeout=self.timeout,
                                check_consistency=self.check_consistency)
            progress.finalizing()  # (the heartbeats say so: scaleout.core.diverged)
            barrier(comm, name="finalize")  # while the watchdog still watches
        if meet:
            watchdog.stop()  # marks this rank as left: finishing is not failing
        if tdist.is_initialized():
            tdist.destroy_process_group()
            release_groups()

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._alive:  # after an error the peers may be gone: do not wait for them
            self._teardown(meet=exc_type is None)

    def __repr__(self) -> str:
        return (f"<Environment rank={self.rank}/{self.world_size} local_rank={self.local_rank} "
                f"backend={self.backend} device={self.device} via {self._info.source}>")


def attached_launch(environ: Mapping[str, str], rank: int, world_size: int) -> LaunchInfo:
    """The launch record of a job that torch.distributed joined without :func:`init` (as
    ``rank`` of ``world_size``): what the launcher's variables say, read as :func:`init`
    reads them (the local rank and size under MPI and Slurm too), where they describe a job
    of that size; else ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as they are."""
    try:
        launch = detect_launch(environ)
    except ValueError:
        launch = None
    if launch is not None and launch.world_size == world_size:
        return dataclasses.replace(launch, rank=rank, source=f"attached ({launch.source})")
    return LaunchInfo(rank=rank, world_size=world_size,
                      local_rank=int(environ.get("LOCAL_RANK", "0")),
                      master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(environ.get("MASTER_PORT", "29500")), source="attached",
                      testbed_host=TESTBED_HOST_VAR in environ)


def attach(*, check_consistency: bool | str = False) -> Environment:
    """An Environment over torch.distributed's already initialised default process group.

    For code (such as a PyTorch front end) given no Environment: it joins the job that
    ``torch.distributed.init_process_group`` or :func:`init` set up. ``check_consistency``
    as :func:`init`'s (default off; ``None``: :func:`init`'s mode, else ``SCALEOUT_CHECK``,
    else ``"first"``). The timeout is the one given to :func:`init` (before: always
    ``DEFAULT_TIMEOUT``, so ``DataParallel(model)`` after ``init(timeout=5)`` waited 300 s
    on a rank that stopped communicating), else ``DEFAULT_TIMEOUT``.

    Raises:
        NotInitializedError: torch.distributed is not initialised.
        ValueError: ``check_consistency`` is not a mode (before stop 49: at
            ``create_distribution``).
    """
    made = _open[-1] if _open else None  # (init's, not finalized)
    if check_consistency is None and made is not None:
        check_consistency = made.check_consistency
    check_consistency = _check_mode(check_consistency, os.environ)
    if not tdist.is_initialized():
        raise NotInitializedError("torch.distributed is not initialised: call scaleout.init() "
                                  "first (or pass a Distribution)")
    info = attached_launch(os.environ, tdist.get_rank(), tdist.get_world_size())
    timeout = made.timeout if made is not None else DEFAULT_TIMEOUT
    return Environment(info, str(tdist.get_backend()), timeout, check_consistency)


def init(backend: str | None = None, timeout: float | timedelta = DEFAULT_TIMEOUT, *,
         check_consistency: bool | str | None = None,
         environ: Mapping[str, str] | None = None) -> Environment:
    """Join the job: detect the launcher, pick a backend and initialise torch.distributed.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or a device map; ``None`` reads
            ``SCALEOUT_BACKEND``, else picks gloo without CUDA, ``cpu:gloo,cuda:nccl`` with
            one GPU per process, and gloo (with CUDA tensors) when processes share a GPU.
        timeout: seconds (or a timedelta) any rendezvous or collective may take before it
            raises an error naming the rank, group and operation.
        check_consistency: verify that all ranks called the same collective (operation,
            dtype, shape, reduce op, root): ``"first"`` (the default) the first time each
            distinct call occurs on a group's communicator, ``"full"`` (or ``True``;
            ``SCALEOUT_CHECK=1``) before every call, ``"off"`` (or ``False``;
            ``SCALEOUT_CHECK=0``). A mismatch is a ValueError naming every rank's call.
            Checked calls wait for every rank. Duplicated communicators (scheduler lanes)
            check only in ``"full"`` mode. The same schedule checks that tensor-parallel
            layers see the same input on every rank of their model group.
        environ: the environment to read the launch from (default ``os.environ``).

    Returns:
        The :class:`Environment`. Use it as a context manager or call ``finalize()``.

    Raises:
        ValueError: an unknown backend, or NCCL where it cannot run (before any rendezvous).
        ScaleoutError: torch.distributed is already initialised, or the rendezvous failed.

    Example:
        >>> env = scaleout.init()          # under `scaleout run -n 2 script.py`
        >>> env.rank, env.world_size
        (0, 2)                             # rank 1 prints (1, 2)
    """
    limit = check_seconds(timeout, "timeout")
    environ = os.environ if environ is None else environ
    info = detect_launch(environ)
    chosen, device = choose_backend(backend, environ=environ, local_rank=info.local_rank)
    watch_parent(environ)  # leave if the launcher dies (a fallback for its parent-death signal)
    mode = _check_mode(check_consistency, environ)
    if tdist.is_initialized():
        raise ScaleoutError(
            "scaleout.init() was called while torch.distributed is already initialised "
            "(init called twice?): call env.finalize() first"
        )
    if "nccl" in chosen:  # NCCL talks to the current device; gloo is told by each tensor
        torch.cuda.set_device(device)
    token = job_token(environ)
    limit_silence = watchdog.heartbeat_limit(environ)
    if not token and info.world_size > 1 and not info.loopback:
        warnings.warn(f"{TOKEN_VAR} is not set: any process that reaches "
                      f"{info.master_addr}:{info.master_port} can join this job; set the same "
                      "secret on every node (scaleout run sets one for single-node jobs)",
                      stacklevel=2)
    job = None
    try:
        if info.world_size == 1:
            tdist.init_process_group(chosen, store=tdist.HashStore(), rank=0, world_size=1,
                                     timeout=timedelta(seconds=limit))
        else:
            # (imported here: launch.rendezvous itself imports the core's errors)
            from scaleout.launch.rendezvous import rendezvous

            agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            job = rendezvous(info, token, limit,  # torchrun's agent serves a store already
                             agent_store=agent, attempt=restart_count(environ))
            tdist.init_process_group(chosen, store=job.store, rank=info.rank,
                                     world_size=info.world_size, timeout=timedelta(seconds=limit))
            progress.finalizing(False)  # (a job after a finalized one in this process)
            if limit_silence is not None:  # (the store's host: rank 0, or torchrun's agent)
                watchdog.start(job, info.rank, info.world_size, limit_silence,
                               store_host=None if agent else 0)
    except (RuntimeError, ValueError) as err:
        hint = f" (is {TOKEN_VAR} the same on every rank?)" if "timeout" in str(err).lower() \
            else ""
        raise ScaleoutError(
            f"rank {info.rank}/{info.world_size}: could not join the rendezvous at "
            f"{info.master_addr}:{info.master_port} (launch detected: {info.source}): "
            f"{err}{hint}") from err
    env = Environment(info, chosen, limit, mode, device=device, rendezvous=job)
    _open.append(env)
    return env


def _leave_at_exit() -> None:
    """At interpreter exit, tear down what :func:`init` set up and nobody finalized.

    Without this, gloo's worker threads outlive the interpreter's finalisation: one that
    frees a finished work's tensors then needs the GIL, the exiting interpreter ends that
    thread inside a C++ destructor, and the process aborts ("terminate called without an
    active exception", SIGABRT: 2 of 20 three-rank runs of a script that returns without
    ``finalize()``; a core dump shows ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllreduceWork`` -> ``decref_pyobject`` -> ``pthread_exit``). Destroying the
    process groups here joins those threads while Python still runs them.

    It runs after the watchdog's exit handler (registered later, so run earlier: atexit is
    last in, first out), which has by then told the peers that this rank departed, or left
    at once after a peer's failure. A teardown that does not end within
    :data:`EXIT_TEARDOWN_S` (a collective this rank started and nobody completes) ends the
    process with status 1 and every thread's traceback (``faulthandler``: no new thread can
    be started this late on every Python).
    """
    for env in reversed(list(_open)):  # (each teardown takes itself out of _open)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        faulthandler.dump_traceback_later(EXIT_TEARDOWN_S, exit=True)
        try:
            env._teardown(meet=False)
        except Exception as err:  # noqa: BLE001 (at exit nobody can handle it: say it)
            print(f"scaleout: rank {env.rank}: tearing torch.distributed down at exit failed: "
                  f"{err}", file=sys.stderr, flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()


atexit.register(_leave_at_exit)  # (before any watchdog registers its handler: runs after it)


def _check_mode(check: bool | str | None, environ: Mapping[str, str]) -> str:
    """The consistency-check mode: the argument, else ``SCALEOUT_CHECK``, else ``"first"``.

    ``"first"`` blocks the first call of each signature until every rank arrives; that would
    deadlock the priority scheduler's lanes (issued on several communicators in a
    timing-dependent order), so duplicated communicators only check in ``"full"`` mode.
    """
    if check is None:
        text = environ.get("SCALEOUT_CHECK", "").strip().lower()
        check = {"": "first", "0": "off", "1": "full"}.get(text, text)
    mode = {True: "full", False: "off"}.get(check, check)  # type: ignore[call-overload]
    if mode not in CHECK_MODES:
        raise ValueError(f"check_consistency (or SCALEOUT_CHECK) must be one of {CHECK_MODES}, "
                         f"a bool, 0 or 1; got {check!r}")
    return mode
