"""The blocking collectives, differentiable as Horovod's are.

``allreduce``, ``grouped_allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and
``reducescatter`` run the non-blocking forms and wait; under autograd, each is a
``torch.autograd.Function`` whose backward is the matching collective of the gradient, with
Horovod's conventions (the gradients of allgather and broadcast are averaged over the set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scaleout.horovod.allreduce import copy_of, refuse_on_every_member, start_allreduce, told_op
from scaleout.horovod.collectives import (
    allgather_async,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    reducescatter_async,
)
from scaleout.horovod.compression import CodecCompression, Compression
from scaleout.horovod.context import runtime
from scaleout.horovod.group import start_group
from scaleout.horovod.handles import submit, synchronize
from scaleout.horovod.ops import Average, ReduceOp, Sum
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter"]


def _reduce(tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
            postscale: float, process_set: ProcessSet, compression: Any = Compression.none) -> torch.Tensor:
    rt = runtime()
    output = copy_of(tensor)
    return synchronize(submit(rt, start_allreduce(
        rt, output, name=name, op=op, prescale=prescale, postscale=postscale,
        compression=compression, process_set=process_set)))


class AllreduceFunction(torch.autograd.Function):
    """allreduce; its gradient is the same allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, prescale: float,
                postscale: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return _reduce(tensor, name, op, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        return _reduce(grad, None, op, prescale, postscale, process_set), None, None, None, None, None


class AllgatherFunction(torch.autograd.Function):
    """allgather; its gradient is this rank's rows of the averaged incoming gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = _reduce(grad, None, Average, 1.0, 1.0, ctx.process_set)
        counts = synchronize(allgather_async(torch.tensor([ctx.rows], device=grad.device), None,
                                             ctx.process_set))
        me = ctx.process_set.rank()
        offset = int(counts[:me].sum())
        return averaged.narrow(0, offset, ctx.rows), None, None


class BroadcastFunction(torch.autograd.Function):
    """broadcast; the root's gradient is the average of the incoming ones, others get zero."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = _reduce(grad, None, Average, 1.0, 1.0, ctx.process_set)
        if runtime().env.rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


class AlltoallFunction(torch.autograd.Function):
    """alltoall; its gradient travels back by the reverse alltoall."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.process_set, ctx.shape = process_set, tensor.shape
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received: Any) -> tuple[Any, ...]:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received.tolist(), None,
                                             ctx.process_set))
        if len(ctx.shape) and back.shape[0] < ctx.shape[0]:  # rows after the splits were not sent: no gradient
            back = torch.cat([back, back.new_zeros((ctx.shape[0] - back.shape[0],
                                                    *ctx.shape[1:]))])
        return back, None, None, None


class ReducescatterFunction(torch.autograd.Function):
    """reducescatter; its gradient is the allgather of the incoming blocks (scaled for Average)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp,
                process_set: ProcessSet, prescale: float, postscale: float) -> torch.Tensor:
        out = synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))
        # (after the call has checked the factors: before stop 52 their product came first,
        # and a factor that is not a number raised here on one rank, before the exchange)
        ctx.args = (op, process_set, float(prescale) * float(postscale))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, scale = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(f"reducescatter with op={op.name} has no gradient; "
                                      "use hvd.Average or hvd.Sum")
        gathered = synchronize(allgather_async(grad.contiguous(), None, process_set))
        if op is Average:
            scale /= process_set.size()
        return gathered * scale, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over the process set, as a new tensor; differentiable.

    As in Horovod, the gradient is the same reduction of the incoming gradients (exact for
    Sum and Average).

    Args:
        tensor: the input (left unchanged).
        average: Horovod's deprecated flag (True: Average, False: Sum).
        name: the tensor's name; members must submit the same names in the same order.
        compression: ``hvd.Compression.none``, ``.fp16`` or ``hvd.Compression.codec(spec)``
            (a codec's result is not differentiable).
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: the ranks taking part.

    Returns:
        The reduced tensor.

    Raises:
        TypeError: not a tensor, unsupported dtype, scale factors on an integer tensor.
        TensorMismatchError: (on every member) names, ops, dtypes or shapes differ.
        NotImplementedError: Adasum on a set whose size is not a power of two.

    Example (2 ranks):
        >>> hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
        tensor([1.])
    """
    op = told_op(op, average, "allreduce", name, process_set)
    if isinstance(compression, CodecCompression) or not isinstance(tensor, torch.Tensor):
        return _reduce(tensor, name, op, prescale_factor, postscale_factor, process_set,
                       compression)
    compressed, ctx = compression.compress(tensor)
    reduced = AllreduceFunction.apply(compressed, name, op, prescale_factor, postscale_factor,
                                      process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allreduce` of each tensor of ``tensors`` (names ``name.0``, ``name.1`` ...).

    Raises:
        TensorMismatchError: (on every member) the members pass different numbers of tensors,
            or see :func:`allreduce`.
    """
    start_group(tensors, name, process_set)
    return [allreduce(t, average, None if name is None else f"{name}.{i}", compression, op,
                      prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dim 0 (row counts may differ); differentiable.

    Example (2 ranks):
        >>> hvd.allgather(torch.full((hvd.rank() + 1,), hvd.rank()))
        tensor([0, 1, 1])
    """
    if not isinstance(tensor, torch.Tensor):  # refused on every rank by the exchange
        return synchronize(allgather_async(tensor, name, process_set))
    return AllgatherFunction.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of ``tensors`` (names ``name.0``, ``name.1`` ...);
    differentiable (since stop 52).

    Raises:
        TensorMismatchError: (on every member) the members pass different numbers of tensors,
            or see :func:`allgather`.
    """
    start_group(tensors, name, process_set, "grouped_allgather")
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Global rank ``root_rank``'s ``tensor``, as a new tensor on every member; differentiable."""
    if not isinstance(tensor, torch.Tensor):  # refused on every rank by the exchange
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))
    return BroadcastFunction.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with global rank ``root_rank``'s and return it (no autograd)."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows to member j (equal blocks without splits); differentiable.

    Returns:
        The received rows; with ``splits`` given, ``(rows, received_splits)`` as in Horovod.
    """
    if not isinstance(tensor, torch.Tensor):  # refused on every rank by the exchange
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    else:
        output, received = AlltoallFunction.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: ReduceOp | None = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """This member's block of the reduction of ``tensor`` (see :func:`reducescatter_async`).

    Raises:
        ValueError: a scaleout codec compression (not supported for reducescatter).
    """
    if isinstance(compression, CodecCompression):  # (told to every member since stop 52)
        refuse_on_every_member(ValueError(
            "reducescatter: scaleout codec compressions apply to allreduce only; use "
            "hvd.Compression.none or .fp16"), "reducescatter", name, process_set)
    op = told_op(op, None, "reducescatter", name, process_set)
    if not isinstance(tensor, torch.Tensor):  # refused on every rank by the exchange
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))
    compressed, ctx = compression.compress(tensor)
    out = ReducescatterFunction.apply(compressed, name, op,
                                      process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)



def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of ``tensors`` (names ``name.0``, ``name.1`` ...);
    differentiable for Average and Sum (since stop 52).

    Raises:
        TensorMismatchError: (on every member) the members pass different numbers of tensors,
            or see :func:`reducescatter`.
    """
    start_group(tensors, name, process_set, "grouped_reducescatter", joinable=False)
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                          process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]
