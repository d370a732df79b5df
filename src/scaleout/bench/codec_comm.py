"""Communicators for exchanging one tensor outside a scaleout job: single-rank loop-back,
and a plain torch.distributed process group (what torch's DDP hooks use).

Both satisfy :class:`scaleout.compression.Communicator`, so a codec's whole exchange
(:func:`~scaleout.compression.compressed_allreduce`) can run, and be timed, beside torch's
own communication hooks on the very same process group.

Example:
    >>> comm = LoopbackComm()
    >>> comm.allreduce(torch.ones(2)).wait().tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.core.collectives import ReduceOp, all_gather_single

__all__ = ["LoopbackComm", "ProcessGroupComm"]

_TORCH_OPS = {ReduceOp.SUM: tdist.ReduceOp.SUM, ReduceOp.MAX: tdist.ReduceOp.MAX,
              ReduceOp.MIN: tdist.ReduceOp.MIN}


class _Done:
    """A request that completed when it was made."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self._result

    def test(self) -> bool:
        return True


class _Pending:
    """A torch.distributed work handle and the tensor it fills."""

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self._work = work
        self._result = result

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        self._work.wait()
        return self._result

    def test(self) -> bool:
        return bool(self._work.is_completed())


class LoopbackComm:
    """One rank talking to itself: every collective returns its input at once.

    Times a codec's exchange with no wire at all (the codec's own work only).
    """

    def allreduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> _Done:
        return _Done(tensor)

    def allgather(self, tensor: torch.Tensor, group: Any = None) -> _Done:
        return _Done(tensor.reshape(-1))

    def allgatherv(self, tensor: torch.Tensor, counts: Sequence[int], group: Any = None) -> _Done:
        return _Done(tensor)

    def size(self, group: Any = None) -> int:
        return 1

    def rank(self, group: Any = None) -> int:
        return 0


class ProcessGroupComm:
    """Non-blocking collectives on a torch.distributed process group.

    Args:
        group: the process group (``None``: the default group).

    Raises:
        ValueError: a reduction torch.distributed lacks (``AVG``), or ``allgatherv``.
    """

    def __init__(self, group: Any = None) -> None:
        self._group = group

    def allreduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None) -> _Pending:
        if op not in _TORCH_OPS:
            raise ValueError(f"ProcessGroupComm: unsupported reduction {op!r}; expected SUM, MAX or MIN")
        work = tdist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._group, async_op=True)
        return _Pending(work, tensor)

    def allgather(self, tensor: torch.Tensor, group: Any = None) -> _Pending:
        flat = tensor.reshape(-1)
        out = flat.new_empty(flat.numel() * self.size())
        work = all_gather_single(out, flat, group=self._group, async_op=True)
        return _Pending(work, out)

    def allgatherv(self, tensor: torch.Tensor, counts: Sequence[int], group: Any = None) -> _Pending:
        raise ValueError("ProcessGroupComm: allgatherv is not supported (no codec needs it)")

    def size(self, group: Any = None) -> int:
        return tdist.get_world_size(self._group)

    def rank(self, group: Any = None) -> int:
        return tdist.get_rank(self._group)
