"""Horovod's allreduce family: ``allreduce(_)(_async)(_)`` and ``grouped_allreduce*``.

Each call checks its signature with the process set (see :mod:`scaleout.horovod.signature`),
starts the core's non-blocking allreduce (or allgather, for Product and Adasum, which the
core has no reduction for) and returns a handle; ``synchronize`` applies the post-processing
(Average's division, ``postscale_factor``, decompression).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from scaleout.compression import compressed_allreduce
from scaleout.core import collectives as coll
from scaleout.core.checks import check_tensor
from scaleout.core.collectives import ReduceOp as CoreOp
from scaleout.core.grid import GroupType
from scaleout.horovod.adasum import adasum_tree, check_adasum_size
from scaleout.horovod.compression import CodecCompression, Compression
from scaleout.horovod.context import Runtime, runtime
from scaleout.horovod.group import run_group
from scaleout.horovod.handles import Key, Pending, require_idle, submit, synchronize
from scaleout.horovod.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum, resolve_op
from scaleout.horovod.process_sets import ProcessSet, global_process_set
from scaleout.horovod.signature import ARGUMENT_ERRORS, attempt, exchange_signature
from scaleout.session.hooks import codec_identity

__all__ = [
    "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "start_allreduce", "require_tensor",
    "copy_of", "multiply", "check_factor", "told_op", "refuse_on_every_member",
]

_CORE_OPS = {Sum: CoreOp.SUM, Average: CoreOp.SUM, Min: CoreOp.MIN, Max: CoreOp.MAX}


def copy_of(tensor: object) -> Any:
    """A detached copy of a tensor; anything else as it is (the checks refuse it later, on
    every rank at once)."""
    return tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor


def require_tensor(tensor: object, operation: str) -> torch.Tensor:
    """``tensor`` if it is a tensor, else a TypeError naming ``operation``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{operation}: expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def multiply(tensor: torch.Tensor, factor: float, in_place: bool = False) -> torch.Tensor:
    """``tensor * factor`` (into ``tensor`` when ``in_place``); an integer tensor is scaled as
    Horovod scales one: in float64, then cast back (truncated toward zero)."""
    if factor == 1.0:
        return tensor
    if not tensor.dtype.is_floating_point:
        product = (tensor.to(torch.float64) * factor).to(tensor.dtype)
        return tensor.copy_(product) if in_place else product
    return tensor.mul_(factor) if in_place else tensor * factor


def refuse_on_every_member(err: Exception, kind: str, name: str | None,
                           process_set: ProcessSet) -> NoReturn:
    """Raise ``err``, a refusal of this rank's arguments found before the call's signature
    exchange, after telling the other members, who raise a ``TensorMismatchError`` naming this
    rank (since stop 52; before, this rank raised at once and the others waited out the
    timeout at the collective)."""
    rt = runtime()
    exchange_signature(process_set.communicator(kind), kind, rt.auto_name(kind, name, process_set),
                       None, refused=err)
    raise err  # (exchange_signature raised it already)


def told_op(op: object, average: object, kind: str, name: str | None,
            process_set: ProcessSet) -> ReduceOp:
    """:func:`resolve_op`, its refusal raised on every member (see
    :func:`refuse_on_every_member`)."""
    chosen, refused = attempt(lambda: resolve_op(op, average, kind))
    if refused is not None:
        refuse_on_every_member(refused, kind, name, process_set)
    return chosen


def check_factor(value: object, what: str, operation: str) -> float:
    """``value`` as a float; TypeError unless it is a number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{operation}: {what} must be a number, got {type(value).__name__}")
    return float(value)


def start_allreduce(rt: Runtime, output: torch.Tensor, *, name: str | None, op: ReduceOp,
                    prescale: float = 1.0, postscale: float = 1.0, compression: Any = Compression.none,
                    process_set: ProcessSet = global_process_set,
                    kind: str = "allreduce") -> Pending:
    """Start reducing ``output`` in place over ``process_set``; the pending result is ``output``.

    Integer tensors are scaled (by the factors, and by ``1 / size`` for Average) in float64
    and truncated toward zero, as Horovod does.

    Raises:
        TypeError: not a tensor, unsupported dtype, or a scale factor that is not a number.
        TensorMismatchError: the members disagree on name, op, dtype or shape, or another
            member's arguments failed these checks.
        NotImplementedError: Adasum on a non-power-of-two set.
        ValueError: a scaleout codec with an op other than Average/Sum, a process set, or
            no name.
    """
    comm = process_set.communicator(kind)
    named = name is not None
    name = rt.auto_name(kind, name, process_set)
    codec = isinstance(compression, CodecCompression)
    send, ctx, refused, key = None, None, None, None
    try:  # every check first: a rank whose arguments fail tells the others, nobody waits
        key = require_idle(rt, process_set.process_set_id, kind, name)
        output = check_tensor(require_tensor(output, kind), kind)
        prescale = check_factor(prescale, "prescale_factor", kind)
        postscale = check_factor(postscale, "postscale_factor", kind)
        if op is Adasum:
            check_adasum_size(comm.size, kind)
        if codec:
            _check_codec(op, process_set, named, kind)
        send, ctx = (output, None) if codec else compression.compress(output)
    except ARGUMENT_ERRORS as err:
        refused = err
    exchange_signature(comm, kind, name, None if refused else output, op=int(op),
                       wire=None if send is None else send.dtype, joinable=not codec,
                       refused=refused, scales=None if refused else (prescale, postscale),
                       codec=codec_identity(compression.codec) if codec else None)
    assert send is not None  # (exchange_signature raised otherwise)
    if codec:
        return _start_codec(rt, output, name, op, prescale, postscale, compression, kind, key)
    send = multiply(send, prescale, in_place=True)
    if op in (Product, Adasum):
        request = coll.allgather(comm, send.unsqueeze(0) if send.dim() else send.reshape(1))
    else:
        request = coll.allreduce(comm, send, _CORE_OPS[op])
    size = comm.size

    def finish(results: list[Any]) -> torch.Tensor:
        reduced = results[0]
        if op is Product:
            reduced = reduced.prod(0, dtype=reduced.dtype).reshape(output.shape)
        elif op is Adasum:
            reduced = adasum_tree(reduced).reshape(output.shape)
        reduced = compression.decompress(reduced, ctx)
        reduced = multiply(reduced, postscale / size if op is Average else postscale)
        if reduced is not output:
            output.copy_(reduced)
        return output

    return Pending(kind=kind, name=name, requests=[request], finish=finish, keys=(key,))


def _check_codec(op: ReduceOp, process_set: ProcessSet, named: bool, kind: str) -> None:
    if op not in (Average, Sum):
        raise ValueError(f"{kind}: a scaleout codec compression reduces with hvd.Average or "
                         f"hvd.Sum, got op={op.name}")
    if process_set is not global_process_set:
        raise ValueError(f"{kind}: a scaleout codec compression runs on the global process set "
                         f"only, got {process_set}")
    if not named:  # an automatic name is new every call: the state would never be read back
        raise ValueError(f"{kind}: a scaleout codec compression keeps its error feedback per "
                         "tensor name, and an unnamed call gets a new name every time; pass "
                         "name= (the same name for the same tensor every step)")


def _start_codec(rt: Runtime, output: torch.Tensor, name: str, op: ReduceOp, prescale: float,
                 postscale: float, compression: CodecCompression, kind: str,
                 key: Key) -> Pending:
    multiply(output, prescale, in_place=True)
    request = compressed_allreduce(compression.codec, output, compression.state(name),
                                   rt.distribution, group=GroupType.GLOBAL, average=op is Average)

    def finish(results: list[Any]) -> torch.Tensor:
        return multiply(output, postscale, in_place=True)

    return Pending(kind=kind, name=name, requests=[request], finish=finish, keys=(key,))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place; returns a handle for :func:`synchronize`.

    Args:
        tensor: the tensor, overwritten with the result.
        average: Horovod's deprecated flag (True: Average, False: Sum).
        name: the tensor's name; members must submit the same names in the same order.
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor, postscale_factor: multiply before / after the reduction (integer
            tensors in float64, truncated toward zero, as in Horovod).
        process_set: the ranks taking part.

    Returns:
        The handle.

    Raises:
        TypeError, ValueError, TensorMismatchError, NotImplementedError: see :func:`start_allreduce`.
    """
    op = told_op(op, average, "allreduce", name, process_set)
    rt = runtime()
    return submit(rt, start_allreduce(rt, tensor, name=name, op=op, prescale=prescale_factor,
                                      postscale=postscale_factor, process_set=process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Like :func:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
    output = copy_of(tensor)
    return allreduce_async_(output, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over the process set and return it (no autograd)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing every tensor of ``tensors`` in place; one handle for all of them."""
    op = told_op(op, average, "grouped_allreduce", name, process_set)
    return run_group(tensors, lambda rt, t, n: start_allreduce(
        rt, t, name=n, op=op, prescale=prescale_factor, postscale=postscale_factor,
        process_set=process_set, kind="grouped_allreduce"), name, process_set,
        "grouped_allreduce")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Like :func:`grouped_allreduce_async_`, into new tensors."""
    copies = [copy_of(t) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place and return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))
