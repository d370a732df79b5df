"""Horovod's ``*_built()`` / ``*_enabled()`` queries, answered for the torch underneath."""

from __future__ import annotations

import torch
import torch.distributed as tdist

__all__ = [
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
]


def mpi_built(verbose: bool = False) -> bool:
    """True when torch.distributed has its MPI backend (scaleout then can use ``backend="mpi"``)."""
    return bool(tdist.is_mpi_available())


def mpi_enabled() -> bool:
    """True when the job communicates through MPI (scaleout uses gloo/NCCL: False)."""
    return False


def mpi_threads_supported() -> bool:
    """Horovod's MPI-thread query; scaleout does not run MPI itself: False."""
    return False


def gloo_built(verbose: bool = False) -> bool:
    """True when torch.distributed has gloo (the CPU transport scaleout uses)."""
    return bool(tdist.is_gloo_available())


def gloo_enabled() -> bool:
    """True: CPU tensors travel over gloo."""
    return gloo_built()


def nccl_built(verbose: bool = False) -> int:
    """The NCCL version number torch was built with (0 when none), like Horovod's."""
    if not (torch.cuda.is_available() and tdist.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, TypeError):
        return 1
    return major * 1000 + minor * 100 + patch


def ddl_built(verbose: bool = False) -> bool:
    """IBM DDL is not supported: False."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """oneCCL is not used by scaleout: False."""
    return False


def cuda_built(verbose: bool = False) -> bool:
    """True when torch was built with CUDA (not ROCm)."""
    return torch.version.cuda is not None


def rocm_built(verbose: bool = False) -> bool:
    """True when torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None
