"""``hvd.join()``: a rank out of data stands in for the others until every rank has joined.

As in Horovod, a joined rank takes part in the allreduces and allgathers the other ranks still
run, contributing a neutral tensor (zeros for Sum, Average and Adasum, ones for Product, the
dtype's extreme for Min and Max; no rows for allgather), so ranks may train on different
numbers of batches. Averages still divide by the set size (joined ranks count, with zeros).
It learns what to stand in for from the signature every collective exchanges first.
"""

from __future__ import annotations

import time

import torch

from scaleout.core import collectives as coll
from scaleout.core.collectives import Communicator
from scaleout.core.collectives import ReduceOp as CoreOp
from scaleout.core.consistency import control_tensor
from scaleout.core.request import Request
from scaleout.horovod.context import runtime
from scaleout.horovod.ops import Adasum, Max, Min, Product, ReduceOp
from scaleout.horovod.signature import GATHERS, Signature, exchange_joined

__all__ = ["join", "gather_rows", "neutral", "last_joined"]


def gather_rows(comm: Communicator, tensor: torch.Tensor, counts: list[int]) -> Request:
    """The core's allgather, or allgatherv when members send different numbers of rows."""
    if len(set(counts)) == 1:
        return coll.allgather(comm, tensor)
    return coll.allgatherv(comm, tensor, counts)


def neutral(op: ReduceOp, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device | None = None) -> torch.Tensor:
    """The tensor that leaves a reduction by ``op`` unchanged (made on ``device``)."""
    if op is Product:
        return torch.ones(shape, dtype=dtype, device=device)
    if op in (Min, Max):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return torch.full(shape, info.max if op is Min else info.min, dtype=dtype,
                          device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _stand_in(comm: Communicator, call: Signature, counts: list[int], device: torch.device) -> None:
    if call.kind in GATHERS:
        empty = torch.empty((0, *call.shape[1:]), dtype=call.wire, device=device)
        gather_rows(comm, empty, counts).wait()
        return
    op = ReduceOp(call.op)
    tensor = neutral(op, call.shape, call.wire, device)
    if op in (Product, Adasum):
        coll.allgather(comm, tensor.unsqueeze(0) if tensor.dim() else tensor.reshape(1)).wait()
    else:
        core = {Min: CoreOp.MIN, Max: CoreOp.MAX}.get(op, CoreOp.SUM)
        coll.allreduce(comm, tensor, core).wait()


def join(device: int = -1) -> int:
    """Stand in for the other ranks' allreduces and allgathers until every rank has joined.

    Args:
        device: the CUDA device of the neutral tensors (``-1``: CPU, as Horovod's default).

    Returns:
        The global rank that joined last, the same on every rank: the rank that ran
        collectives with the others longest (the fewest exchanges inside ``join``); among
        ranks that joined between the same two collectives, the latest by wall clock (as
        Horovod's coordinator sees them arrive). Before stop 52 wall clock alone decided,
        which names the wrong rank when hosts' clocks differ by more than the time between
        the joins.

    Afterwards every rank numbers its unnamed collectives from 0 again (``allreduce.noname.0``
    ...), so that calls after the join match whatever each rank ran before it.

    Example:
        >>> for batch in my_batches:        # ranks may have different numbers of batches
        ...     train_step(batch)
        >>> hvd.join()
    """
    rt = runtime()
    comm = rt.comm
    place = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    joined_at = time.time()
    exchanges = 0  # the signature exchanges this rank took part in while joined
    while comm.size > 1:
        seen = exchange_joined(comm)
        exchanges += 1
        if seen is None:
            break
        call, counts = seen
        if call is not None:
            _stand_in(comm, call, counts, place)
    stamps = coll.allgather(comm, control_tensor(comm, [[-exchanges, joined_at]],
                                                 torch.float64)).wait()
    # The ranks that stood in for the others' unnamed calls did not count them, so the
    # counters behind automatic names (``allreduce.noname.<n>``) now differ between ranks.
    # Every rank leaves the join at this same point, so each restarts every count from 0:
    # aligned without another exchange (agreeing on the counts would need one, of a set of
    # (process set, collective) keys that may differ between ranks). Names serve only to
    # match calls (and label the timeline), so reusing one after the join is harmless.
    rt.names.clear()
    return last_joined(stamps.cpu().tolist())


def last_joined(stamps: list[list[float]]) -> int:
    """The index of the rank that joined last, from every rank's ``[-exchanges, time]``:
    the fewest exchanges while joined, then the latest time (then the highest index)."""
    return max(range(len(stamps)), key=lambda i: (stamps[i][0], stamps[i][1], i))
