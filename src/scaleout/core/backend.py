"""Which torch.distributed backend and device a rank uses, from the GPUs it sees and the
launcher's process count on its node."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["choose_backend", "local_world_size"]

_BACKENDS = ("gloo", "nccl", "mpi")


#: Where launchers put the number of processes on this node (torchrun / scaleout run,
#: Open MPI, MPICH).
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def local_world_size(environ: Mapping[str, str], local_rank: int) -> int:
    """Processes on this node, from the launcher's variables (at least ``local_rank + 1``)."""
    for name in _LOCAL_SIZE_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return max(int(value), local_rank + 1)
    return local_rank + 1


def _choose_backend(backend: str | None, *, cuda_devices: int, local_world_size: int,
                    local_rank: int = 0, environ: Mapping[str, str] | None = None,
                    ) -> tuple[str, torch.device]:
    """The torch.distributed backend and this rank's default device; a pure function.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"``, a device map such as
            ``"cpu:gloo,cuda:nccl"``, or ``None``: ``SCALEOUT_BACKEND`` from ``environ``
            if set, else automatic.
        cuda_devices: GPUs this process sees (``torch.cuda.device_count()``).
        local_world_size: processes on this node.
        local_rank: this process's rank on the node.
        environ: where ``SCALEOUT_BACKEND`` is read (default: nowhere).

    Returns:
        ``(backend, device)``. Automatic: ``"gloo"`` and the CPU without CUDA;
        ``"cpu:gloo,cuda:nccl"`` with one GPU per process; ``"gloo"`` (with CUDA tensors)
        when processes share GPUs, which NCCL refuses. The device is
        ``cuda:{local_rank % cuda_devices}`` whenever there is a GPU.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: an unknown backend, or NCCL where it cannot run (no GPU, or more
            processes on this node than GPUs), before any rendezvous.

    Example:
        >>> _choose_backend(None, cuda_devices=1, local_world_size=2)
        ('gloo', device(type='cuda', index=0))
    """
    device = torch.device("cuda", local_rank % cuda_devices) if cuda_devices > 0 else torch.device("cpu")
    source = "backend"
    if backend is None and environ is not None and environ.get("SCALEOUT_BACKEND", "").strip():
        backend, source = environ["SCALEOUT_BACKEND"].strip(), "SCALEOUT_BACKEND"
    if backend is None:
        if cuda_devices == 0:
            return "gloo", device
        return ("cpu:gloo,cuda:nccl" if local_world_size <= cuda_devices else "gloo"), device
    names = _backend_names(backend, source)
    if "nccl" in names and cuda_devices == 0:
        raise ValueError(f"backend {backend!r} ({source}) needs NCCL, which needs CUDA, but this "
                         "process sees no GPU; use 'gloo'")
    if "nccl" in names and local_world_size > cuda_devices:
        raise ValueError(
            f"backend {backend!r} ({source}) needs NCCL, which needs one GPU per process, but "
            f"{local_world_size} processes on this node share {cuda_devices} GPU(s); use 'gloo' "
            "(it carries CUDA tensors too), or leave the backend to scaleout")
    return backend, device


def _backend_names(backend: object, source: str) -> list[str]:
    """The backends a ``backend`` setting names; TypeError / ValueError unless known."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    names = [part.split(":")[-1].strip() for part in backend.split(",")]
    unknown = [name for name in names if name not in _BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend {backend!r} ({source}): expected one of {_BACKENDS} "
                         "or a device map like 'cpu:gloo,cuda:nccl'")
    return names


def choose_backend(backend: str | None = None, *, environ: Mapping[str, str] | None = None,
                   local_rank: int = 0) -> tuple[str, torch.device]:
    """What :func:`init` chooses for this process: :func:`_choose_backend` with the GPUs
    torch sees and the node's process count from the launcher's variables.

    Args:
        backend: as for :func:`init` (``None``: ``SCALEOUT_BACKEND``, else automatic).
        environ: the launcher's variables (default ``os.environ``).
        local_rank: this process's rank on the node.

    Returns:
        ``(backend, device)``.

    Raises:
        ValueError, TypeError: as :func:`_choose_backend`.
    """
    environ = os.environ if environ is None else environ
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return _choose_backend(backend, cuda_devices=cuda_devices, local_rank=local_rank,
                           local_world_size=local_world_size(environ, local_rank), environ=environ)
