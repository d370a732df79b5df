"""The process group ``bench codecs`` times exchanges on: two ranks, this process (rank 0,
which measures) and a peer process it starts (rank 1), over loopback.

At world size 1 an exchange moves nothing, and a codec may take a path training never takes
(scaleout's cast codec returns before casting when its group has one rank), so the exchange
and torch's hooks are timed on two ranks: gloo for CPU tensors, NCCL for CUDA ones with the
peer on another GPU. With one GPU (NCCL cannot put two ranks on one device) or ``ranks=1``
the group has one rank, and the report says so. The peer runs the same program as rank 0
(:func:`scaleout.bench.codecs.run_rank`) without timing anything of its own, and dies with
this process (:func:`scaleout.launch.lifeline.die_with_parent`).

Every collective phase starts with :meth:`Group.meet` (both ranks start together: rank 0
does not time the peer's catching up), and :meth:`Group.agree` makes every rank give up on
a codec when one of them failed, so that the ranks never wait on different collectives.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from scaleout.launch.lifeline import die_with_parent

__all__ = ["Group", "PeerFailed", "describe", "exchange_group", "join_as_peer", "peer_device"]

#: Seconds a collective (and the peer's rendezvous) may take.
TIMEOUT_S = 120.0
#: Seconds the peer may take to leave once rank 0 is done.
LEAVE_S = 60.0

T = TypeVar("T")


class PeerFailed(RuntimeError):
    """Another rank failed in a phase this rank finished."""


@dataclass(frozen=True, kw_only=True)
class Group:
    """The exchange's process group as one rank sees it.

    Attributes:
        rank: this rank (0 measures and reports).
        world: ranks in the group (2, or 1: see the module doc).
        device: the tensors' device.
        backend: the process group's backend.
        why_alone: with ``world == 1``, why (else ``None``).
    """

    rank: int
    world: int
    device: torch.device
    backend: str
    why_alone: str | None = None

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def meet(self) -> None:
        """Every rank here (a one-element all-reduce on the device, then its kernels done)."""
        if self.world > 1:
            tdist.all_reduce(torch.zeros(1, device=self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def phase(self, run: Callable[[], T]) -> T:
        """``run()`` on every rank, then agree on whether all of them succeeded: a rank's
        own error is raised where it failed, :class:`PeerFailed` on the others."""
        try:
            result, failure = run(), None
        except Exception as err:  # noqa: BLE001 - raised below, after the ranks agree
            result, failure = None, err
        if not self.agree(failure is None):
            raise failure if failure is not None else PeerFailed("the peer rank failed here")
        return result  # type: ignore[return-value]

    def agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (every rank must call it)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=self.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MIN)
        return bool(flag.item() > 0)


def peer_device(device: torch.device) -> torch.device:
    """The peer's device: the CPU, or the next GPU after ``device``'s."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", ((device.index or 0) + 1) % torch.cuda.device_count())


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def exchange_group(device: torch.device, ranks: int,
                   peer_argv: Sequence[str]) -> Iterator[Group]:
    """A process group for the exchange, rank 0 here (destroyed on exit, the peer gone).

    Args:
        device: this rank's device.
        ranks: 2 (a peer process) or 1.
        peer_argv: the peer's ``python`` arguments; ``--port PORT`` is appended.

    Raises:
        RuntimeError: the peer failed (its output is in the message).
    """
    if tdist.is_initialized():  # (inside a job: its group as it is)
        yield Group(rank=tdist.get_rank(), world=tdist.get_world_size(), device=device,
                    backend=str(tdist.get_backend()))
        return
    why = ("asked" if ranks == 1 else "one GPU: NCCL puts one rank on a device"
           if device.type == "cuda" and torch.cuda.device_count() < 2 else None)
    backend = _backend(device)
    timeout = timedelta(seconds=TIMEOUT_S)
    if why is not None:
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1,
                                 timeout=timeout)
        try:
            yield Group(rank=0, world=1, device=device, backend=backend, why_alone=why)
        finally:
            tdist.destroy_process_group()
        return
    store = tdist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout,
                           wait_for_workers=False)
    import scaleout

    env = dict(os.environ)  # (the peer imports this scaleout, whatever its path)
    source = str(Path(scaleout.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    peer = subprocess.Popen([sys.executable, *peer_argv, "--port", str(store.port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent(os.getpid()))
    try:
        tdist.init_process_group(backend, store=store, rank=0, world_size=2, timeout=timeout)
        try:
            yield Group(rank=0, world=2, device=device, backend=backend)
        finally:
            tdist.destroy_process_group()
        try:
            _, err = peer.communicate(timeout=LEAVE_S)
        except subprocess.TimeoutExpired:
            peer.kill()
            _, err = peer.communicate()
        if peer.returncode != 0:
            raise RuntimeError(f"bench codecs: the peer rank failed (exit code "
                               f"{peer.returncode}):\n{(err or '')[-3000:]}")
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


def join_as_peer(device: torch.device, port: int) -> Group:
    """Join rank 0's group as rank 1 (in the peer process); destroy it when done."""
    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=False,
                           timeout=timedelta(seconds=TIMEOUT_S))
    backend = _backend(device)
    tdist.init_process_group(backend, store=store, rank=1, world_size=2,
                             timeout=timedelta(seconds=TIMEOUT_S))
    return Group(rank=1, world=2, device=device, backend=backend)


def describe(group: Group) -> dict[str, Any]:
    """The group as the report gives it."""
    return {"exchange_ranks": group.world, "exchange_backend": group.backend,
            "exchange_alone": group.why_alone}
