"""Before each collective the members exchange what they are about to do, and refuse a mismatch.

Horovod's coordinator negotiates every tensor by name and reports "Mismatched ... shapes"
instead of hanging. The face does the same with one small allgather (one row of int64 per
rank: name, collective, op, dtype, root, shape) on the core's collectives; every member sees
every row, so all of them raise the same error, before any data moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from scaleout.core import collectives as coll
from scaleout.core.collectives import Communicator
from scaleout.horovod.errors import TensorMismatchError

__all__ = ["exchange_signature", "DTYPES"]

DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.float32, torch.float64, torch.bfloat16, torch.bool)
_MAX_DIMS = 8
# columns: name, kind, op, dtype, root, ndim, dims..., hash of dims past _MAX_DIMS
_NAME, _KIND, _OP, _DTYPE, _ROOT, _NDIM, _DIMS = 0, 1, 2, 3, 4, 5, 6
_WIDTH = _DIMS + _MAX_DIMS + 1


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _row(name: str, kind: str, op: int, tensor: torch.Tensor, root: int) -> list[int]:
    dims = list(tensor.shape)
    shown = dims[:_MAX_DIMS] + [-1] * (_MAX_DIMS - min(len(dims), _MAX_DIMS))
    dtype = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else 100 + _hash(str(tensor.dtype)) % 1000
    return [_hash(name), _hash(kind), op, dtype, root, len(dims), *shown,
            _hash(repr(dims[_MAX_DIMS:]))]


def _shape(row: Sequence[int]) -> list[int] | str:
    ndim = row[_NDIM]
    if ndim > _MAX_DIMS:
        return f"{ndim}-d"
    return list(row[_DIMS:_DIMS + ndim])


def _dtype(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "another dtype"


def exchange_signature(comm: Communicator, kind: str, name: str, tensor: torch.Tensor, *,
                       op: int = -1, root: int = -1, rows_may_differ: bool = False) -> list[int]:
    """Exchange this call's signature with the group and raise unless all agree.

    Args:
        comm: the process set's communicator.
        kind: the collective (``"allreduce"``, ``"allgather"`` ...).
        name: the tensor's name (Horovod's ``name=`` or its generated one).
        tensor: the tensor this rank passes.
        op: the reduction, when the collective has one.
        root: the root rank, when it has one.
        rows_may_differ: dim 0 may differ between ranks (allgather, alltoall).

    Returns:
        Every member's dim-0 length, in group-rank order (the counts of an allgatherv).

    Raises:
        TensorMismatchError: on every member, when any member differs; the message names the
            first differing member and what it passed.
    """
    mine = _row(name, kind, op, tensor, root)
    if comm.size == 1:
        return [tensor.shape[0] if tensor.dim() else 1]
    table = coll.allgather(comm, torch.tensor([mine], dtype=torch.int64)).wait().tolist()
    for member, row in enumerate(table):
        if row == mine:
            continue
        where = (f"rank {comm.global_rank}: {kind} {name!r} on group {comm.label}: group rank "
                 f"{member} (global rank {comm.ranks[member]})")
        if row[_KIND] != mine[_KIND]:
            raise TensorMismatchError(f"{where} called a different collective at the same "
                                      f"point (this rank: {kind})")
        if row[_NAME] != mine[_NAME]:
            raise TensorMismatchError(f"{where} named its tensor differently (this rank: "
                                      f"{name!r}): ranks must submit the same names in the same order")
        if row[_OP] != mine[_OP]:
            raise TensorMismatchError(f"{where}: mismatched reduction ops (op {row[_OP]} there, "
                                      f"{op} here)")
        if row[_ROOT] != mine[_ROOT]:
            raise TensorMismatchError(f"{where}: mismatched root ranks ({row[_ROOT]} there, "
                                      f"{root} here)")
        if row[_DTYPE] != mine[_DTYPE]:
            raise TensorMismatchError(f"{where}: mismatched data types: {_dtype(row[_DTYPE])} "
                                      f"there, {_dtype(mine[_DTYPE])} here")
        same_tail = row[_NDIM] == mine[_NDIM] and row[_DIMS + 1:] == mine[_DIMS + 1:]
        if not (rows_may_differ and same_tail):
            what = "trailing shapes (dims after the first)" if rows_may_differ else "shapes"
            raise TensorMismatchError(f"{where}: mismatched {what}: {_shape(row)} there, "
                                      f"{_shape(mine)} here")
    return [row[_DIMS] if row[_NDIM] else 1 for row in table]
