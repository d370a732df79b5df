"""Horovod's other collectives, non-blocking: allgather, broadcast, alltoall, reducescatter;
and the blocking ``barrier``.

Each ``*_async`` call checks its signature with the process set, starts the core's
collective and returns a handle for :func:`scaleout.horovod.synchronize`. The blocking,
differentiable forms live in :mod:`scaleout.horovod.autograd`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scaleout.core import collectives as coll
from scaleout.core.checks import check_counts, check_tensor
from scaleout.core.collectives import Communicator
from scaleout.core.collectives import ReduceOp as CoreOp
from scaleout.core.consistency import control_tensor
from scaleout.horovod.allreduce import check_factor, copy_of, multiply, require_tensor
from scaleout.horovod.context import Runtime, runtime
from scaleout.horovod.handles import Pending, require_idle, submit
from scaleout.horovod.join import gather_rows
from scaleout.horovod.ops import Average, Max, Min, ReduceOp, Sum, resolve_op
from scaleout.horovod.process_sets import ProcessSet, global_process_set, root_index
from scaleout.horovod.signature import attempt, exchange_signature

__all__ = [
    "allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
    "reducescatter_async", "barrier", "reducescatter_rows", "start_allgather",
    "start_reducescatter",
]


def start_allgather(rt: Runtime, tensor: torch.Tensor, name: str | None,
                    process_set: ProcessSet, kind: str = "allgather") -> Pending:
    """Start concatenating every member's ``tensor`` along dim 0; the pending result is the
    concatenation. ``kind`` names the call (``"grouped_allgather"`` for a group's tensor).

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        TensorMismatchError: the members disagree on name, dtype or trailing shape.
    """
    comm = process_set.communicator(kind)
    name = rt.auto_name(kind, name, process_set)
    key, busy = attempt(lambda: require_idle(rt, process_set.process_set_id, kind, name))
    tensor, refused = attempt(lambda: check_tensor(require_tensor(tensor, kind), kind))
    counts = exchange_signature(comm, kind, name, tensor, rows_may_differ=True, joinable=True,
                                refused=refused or busy)
    request = gather_rows(comm, tensor.detach(), counts)
    return Pending(kind=kind, name=name, requests=[request], finish=lambda r: r[0], keys=(key,))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every member's ``tensor`` along dim 0; returns a handle.

    Members may pass different numbers of rows; the other dims and the dtype must agree.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        TensorMismatchError: the members disagree on name, dtype or trailing shape.
    """
    rt = runtime()
    return submit(rt, start_allgather(rt, tensor, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` with global rank ``root_rank``'s; returns a handle.

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        ValueError: ``root_rank`` is not a member of the process set.
        TensorMismatchError: the members disagree on name, root, dtype or shape.
    """
    kind = "broadcast"
    rt = runtime()
    comm = process_set.communicator(kind)
    name = rt.auto_name(kind, name, process_set)
    tensor, refused = attempt(lambda: check_tensor(require_tensor(tensor, kind), kind))
    root, refused_root = attempt(lambda: root_index(comm, root_rank, kind))
    key, busy = attempt(lambda: require_idle(rt, process_set.process_set_id, kind, name))
    exchange_signature(comm, kind, name, tensor, root=root if root is not None else -1,
                       refused=refused or refused_root or busy)
    request = coll.bcast(comm, tensor, root)
    return submit(rt, Pending(kind=kind, name=name, requests=[request], finish=lambda r: r[0],
                              keys=(key,)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Like :func:`broadcast_async_`, into a new tensor."""
    output = copy_of(tensor)
    return broadcast_async_(output, root_rank, name, process_set)


def _splits(splits: object, comm: Communicator, tensor: torch.Tensor) -> list[int]:
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % comm.size:
            raise ValueError(f"alltoall: without splits, dim 0 ({rows}) must be a multiple of "
                             f"the process set size {comm.size}; pass splits=")
        return [rows // comm.size] * comm.size
    values = check_counts(splits, comm.size, "splits", "alltoall")
    # As Horovod, splits may cover fewer rows than dim 0 (the rows after them are not sent);
    # before stop 52 anything but the exact sum was refused.
    if sum(values) > rows:
        raise ValueError(f"alltoall: splits add up to more than dim 0 of the tensor ({rows}): "
                         f"got {values} (sum {sum(values)})")
    return values


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``tensor`` to member j; returns a handle.

    ``synchronize`` returns ``(output, received_splits)``: the rows received, concatenated in
    member order, and how many came from each member (an int32 tensor).

    Raises:
        TypeError: not a tensor, unsupported dtype, or splits that are not ints.
        ValueError: splits of the wrong length, or adding up to more than dim 0 (or no splits
            and rows that do not divide evenly). Splits that add up to less leave the rows
            after them unsent, as in Horovod.
        TensorMismatchError: the members disagree on name, dtype or trailing shape.
    """
    kind = "alltoall"
    rt = runtime()
    comm = process_set.communicator(kind)
    name = rt.auto_name(kind, name, process_set)
    tensor, refused = attempt(lambda: check_tensor(require_tensor(tensor, kind), kind))
    send_counts, refused_splits = attempt(lambda: _splits(splits, comm, tensor)) \
        if refused is None else (None, None)
    key, busy = attempt(lambda: require_idle(rt, process_set.process_set_id, kind, name))
    exchange_signature(comm, kind, name, tensor, rows_may_differ=True,
                       refused=refused or refused_splits or busy)
    received = coll.alltoall(comm, control_tensor(comm, send_counts)).wait()
    recv_counts = [int(n) for n in received.tolist()]
    send = tensor.detach()
    if send.dim() and sum(send_counts) < send.shape[0]:
        send = send.narrow(0, 0, sum(send_counts))
    request = coll.alltoallv(comm, send, send_counts, recv_counts)

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return results[0], torch.tensor(recv_counts, dtype=torch.int32)

    return submit(rt, Pending(kind=kind, name=name, requests=[request], finish=finish,
                              keys=(key,)))


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's split of ``rows`` over ``size`` members: the first ``rows % size`` get one more."""
    return [rows // size + (1 if i < rows % size else 0) for i in range(size)]


def start_reducescatter(rt: Runtime, tensor: torch.Tensor, name: str | None, op: ReduceOp | None,
                        process_set: ProcessSet, prescale: float = 1.0, postscale: float = 1.0,
                        kind: str = "reducescatter") -> Pending:
    """Start reducing ``tensor`` over the set; the pending result is this member's block of
    dim 0. ``kind`` names the call (``"grouped_reducescatter"`` for a group's tensor).

    Raises:
        TypeError: not a tensor, an unsupported dtype, or a scale factor that is not a number.
        ValueError: an op other than Average, Sum, Min or Max, or a 0-d tensor.
        TensorMismatchError: the members disagree on name, op, dtype, shape or scale factors.
    """
    comm = process_set.communicator(kind)
    name = rt.auto_name(kind, name, process_set)

    def check() -> tuple[torch.Tensor, ReduceOp, tuple[float, float]]:
        chosen = resolve_op(op, None, kind)
        if chosen not in (Average, Sum, Min, Max):
            raise ValueError(f"{kind}: op must be hvd.Average, Sum, Min or Max, got {chosen.name}")
        checked = check_tensor(require_tensor(tensor, kind), kind)
        if not checked.dim():
            raise ValueError(f"{kind}: needs a tensor of at least one dimension (its rows are "
                             "scattered), got a 0-d tensor")
        # (before stop 52 unchecked: a string failed in the multiplication, after the exchange,
        # and the factors were not compared: ranks that scaled differently mixed silently)
        return checked, chosen, (check_factor(prescale, "prescale_factor", kind),
                                 check_factor(postscale, "postscale_factor", kind))

    checked, refused = attempt(check)
    tensor, op, scales = checked if checked is not None else (None, Sum, None)
    key, busy = attempt(lambda: require_idle(rt, process_set.process_set_id, kind, name))
    exchange_signature(comm, kind, name, tensor, op=int(op), refused=refused or busy,
                       scales=scales)
    assert scales is not None  # (exchange_signature raised otherwise)
    send = multiply(tensor.detach(), scales[0])
    core_op = {Sum: CoreOp.SUM, Average: CoreOp.SUM, Min: CoreOp.MIN, Max: CoreOp.MAX}[op]
    rows = reducescatter_rows(send.shape[0], comm.size)
    if len(set(rows)) == 1:
        request = coll.reduce_scatter(comm, send, core_op)
        block = None
    else:  # uneven blocks: reduce everything, keep this member's rows
        request = coll.allreduce(comm, send.clone(), core_op)
        block = (sum(rows[:comm.rank]), rows[comm.rank])
    scale = scales[1] / comm.size if op is Average else scales[1]

    def finish(results: list[Any]) -> torch.Tensor:
        out = results[0] if block is None else results[0].narrow(0, *block)
        return multiply(out, scale)

    return Pending(kind=kind, name=name, requests=[request], finish=finish, keys=(key,))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set; member i receives the i-th block of dim 0.

    Blocks are as equal as can be, the first ``rows % size`` members getting one more row.
    Integer tensors are scaled (by the factors, and by ``1 / size`` for Average) in float64
    and truncated toward zero, as Horovod does.

    Raises:
        TypeError: not a tensor, an unsupported dtype, or a scale factor that is not a number.
        ValueError: an op other than Average, Sum, Min or Max, or a 0-d tensor.
        TensorMismatchError: the members disagree on name, op, dtype, shape or scale factors.
    """
    rt = runtime()
    return submit(rt, start_reducescatter(rt, tensor, name, op, process_set, prescale_factor,
                                          postscale_factor))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every member of the process set arrives (bounded by the job's timeout).

    Raises:
        TensorMismatchError: (on every member) a member called another collective here, or
            has called ``hvd.join()``.
    """
    kind = "barrier"
    comm = process_set.communicator(kind)
    # the signature exchange is the barrier (no member leaves an allgather before every
    # member entered it), and a joined rank reads it and refuses, as for other collectives
    exchange_signature(comm, kind, runtime().auto_name(kind, None, process_set), torch.empty(0))
