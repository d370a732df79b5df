"""``hvd.init()``: join the job, register process sets, start the timeline ``HOROVOD_TIMELINE`` names."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from scaleout.horovod import context
from scaleout.horovod.process_sets import ProcessSet
from scaleout.horovod.timeline import start_timeline

__all__ = ["init"]


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None, *,
         timeout: float | None = None, backend: str | None = None) -> None:
    """Join the job (Horovod's ``hvd.init``); calling it again while running does nothing.

    Rank and size come from torchrun, Open MPI, MPICH/PMI, Slurm or ``HOROVOD_RANK``/
    ``HOROVOD_SIZE`` variables (``scaleout run`` sets torchrun's); when torch.distributed is
    already initialised (say by ``scaleout.init()``), the face joins that job. With
    ``HOROVOD_TIMELINE=path`` set, a timeline is recorded from here to ``hvd.shutdown()``.

    Args:
        comm: Horovod's MPI communicator argument; only ``None`` is supported.
        process_sets: sets to register now (as :func:`add_process_set` does), or Horovod's
            ``"dynamic"``: none now (sets may be added and removed at any time, with or
            without it).
        timeout: seconds any collective may take (default ``HOROVOD_GLOO_TIMEOUT_SECONDS``,
            else scaleout's 300 s).
        backend: a scaleout backend (default gloo, plus NCCL for CUDA tensors).

    Raises:
        NotImplementedError: ``comm`` is given.
        ValueError: ``process_sets`` is a string other than ``"dynamic"``.
        ScaleoutError: the rendezvous failed.

    Example (under ``scaleout run -n 2``):
        >>> hvd.init(); hvd.rank(), hvd.size()
        (0, 2)                             # rank 1 prints (1, 2)
    """
    running = context.is_initialized()
    context.start(comm, process_sets, timeout=timeout, backend=backend)
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and not running:
        start_timeline(path)
