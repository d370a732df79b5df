"""Before each collective the members exchange what they are about to do, and refuse a mismatch.

Horovod's coordinator negotiates every tensor by name and reports "Mismatched ... shapes"
instead of hanging. The face does the same with one small allgather (one row of int64 per
rank: name, collective, op, dtype, root, shape, wire dtype, codec) on the core's collectives;
every member sees every row, so all of them raise the same error, before any data moves.

A call of several tensors (``grouped_allreduce``, ``broadcast_parameters``) first exchanges a
*header* row holding how many tensors each rank passes, so that different numbers are an error
on every rank, not a rank left waiting or a tensor paired with the next call's.

A rank that called ``hvd.join()`` sends a *joined* row instead and stands in for the others'
allreduces and allgathers (see :mod:`scaleout.horovod.join`); the active ranks skip its row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from scaleout.core import collectives as coll
from scaleout.core.collectives import Communicator
from scaleout.core.consistency import control_tensor
from scaleout.core.errors import CommunicationError, CommunicationTimeout, PeerFailedError
from scaleout.horovod.errors import TensorMismatchError

__all__ = ["exchange_signature", "exchange_count", "exchange_joined", "attempt", "Signature",
           "DTYPES", "JOINABLE", "GATHERS", "ARGUMENT_ERRORS"]

#: what a call's argument checks raise; such a refusal travels in the signature exchange
ARGUMENT_ERRORS = (TypeError, ValueError, NotImplementedError)

DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.float32, torch.float64, torch.bfloat16, torch.bool)
#: collectives a joined rank can stand in for
JOINABLE = ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather")
#: the joinable collectives whose members may pass different numbers of rows
GATHERS = ("allgather", "grouped_allgather")
_MAX_DIMS = 8
# columns: name, kind, op, dtype, root, ndim, dims..., hash of dims past _MAX_DIMS, wire dtype,
# joinable (1: a joined rank can stand in for this call), refused (1: this rank's arguments
# were refused, it raises and sends nothing), count (a header's number of tensors, else -1),
# scales (a hash of an allreduce's prescale and postscale factors, else 0), auto (n of an
# automatic name <kind>.noname.<n>, else -1: told in the error when names differ), codec (a
# hash of an allreduce's scaleout codec with its options, else 0)
_NAME, _KIND, _OP, _DTYPE, _ROOT, _NDIM, _DIMS = 0, 1, 2, 3, 4, 5, 6
_TAIL = _DIMS + _MAX_DIMS
_WIRE, _JOINABLE, _REFUSED, _COUNT = _TAIL + 1, _TAIL + 2, _TAIL + 3, _TAIL + 4
_SCALES, _AUTO, _CODEC = _COUNT + 1, _COUNT + 2, _COUNT + 3
_WIDTH = _CODEC + 1


def _auto_number(name: str, kind: str) -> int:
    """n of Horovod's automatic name ``<kind>.noname.<n>``, or -1 for another name."""
    prefix = f"{kind}.noname."
    number = name.removeprefix(prefix)
    automatic = name.startswith(prefix) and number.isdecimal() and len(number) < 18
    return int(number) if automatic else -1


def _names_differ(where: str, kind: str, name: str, mine: int, theirs: int) -> str:
    """The message when two members' names differ, with the likely cause for automatic ones."""
    text = f"{where} named its tensor differently (this rank: {name!r}"
    if mine < 0 and theirs < 0:
        return f"{text}): ranks must submit the same names in the same order"
    if mine >= 0 and theirs >= 0:
        return (f"{text}, that rank: '{kind}.noname.{theirs}'): both names are automatic "
                "(unnamed calls are numbered in order, per process set and collective), so "
                f"the ranks have run different numbers of unnamed {kind} calls on this process "
                "set before this one; issue the same unnamed collectives on every member, or "
                "pass name=")
    which = "this rank's" if mine >= 0 else "that rank's"
    return (f"{text}): {which} name is automatic (an unnamed call) and the other's is not: "
            "the ranks disagree on which calls are named, or ran different numbers of unnamed "
            f"{kind} calls on this process set; pass the same name= on every member")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


_JOINED = _hash("joined")


def _code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else 100 + _hash(str(dtype)) % 1000


def _row(name: str, kind: str, op: int, tensor: torch.Tensor, root: int, wire: torch.dtype,
         joinable: bool, count: int, scales: tuple[float, float] | None,
         codec: str | None) -> list[int]:
    dims = list(tensor.shape)
    shown = dims[:_MAX_DIMS] + [-1] * (_MAX_DIMS - min(len(dims), _MAX_DIMS))
    joinable = joinable and len(dims) <= _MAX_DIMS and tensor.dtype in DTYPES
    return [_hash(name), _hash(kind), op, _code(tensor.dtype), root, len(dims), *shown,
            _hash(repr(dims[_MAX_DIMS:])), _code(wire), int(joinable), 0, count,
            0 if scales is None else _hash(repr(tuple(map(float, scales)))),
            _auto_number(name, kind), 0 if codec is None else _hash(codec)]


def _shape(row: Sequence[int]) -> list[int] | str:
    ndim = row[_NDIM]
    if ndim > _MAX_DIMS:
        return f"{ndim}-d"
    return list(row[_DIMS:_DIMS + ndim])


def _dtype(code: int) -> str:
    return str(DTYPES[code]).removeprefix("torch.") if 0 <= code < len(DTYPES) else "another dtype"


@dataclass(frozen=True)
class Signature:
    """What an active rank announced, as a joined rank reads it.

    Attributes:
        kind: the collective (one of :data:`JOINABLE`), or ``None`` for one a joined rank
            cannot stand in for, and for a header (nothing moves).
        op: the reduction (Horovod's op number).
        wire: the dtype of the tensor on the wire.
        shape: the shape on the wire (dim 0 of the announcing rank).
    """

    kind: str | None
    op: int
    wire: torch.dtype
    shape: tuple[int, ...]


def _decode(row: Sequence[int]) -> Signature:
    kinds = {_hash(k): k for k in JOINABLE}
    kind = kinds.get(row[_KIND]) if row[_JOINABLE] and row[_COUNT] < 0 else None
    wire = DTYPES[row[_WIRE]] if 0 <= row[_WIRE] < len(DTYPES) else torch.uint8
    shape = tuple(row[_DIMS:_DIMS + row[_NDIM]]) if row[_NDIM] <= _MAX_DIMS else ()
    return Signature(kind=kind, op=row[_OP], wire=wire, shape=shape)


def attempt(check: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """``(check(), None)``, or ``(None, error)`` when the arguments fail their checks.

    The error goes to :func:`exchange_signature` as ``refused``, so that every member raises.
    """
    try:
        return check(), None
    except ARGUMENT_ERRORS as err:
        return None, err


def _gather(comm: Communicator, row: list[int], kind: str, name: str) -> list[list[int]]:
    try:
        return coll.allgather(comm, control_tensor(comm, [row])).wait().tolist()
    except CommunicationError as err:  # say which call of the user's it was, once
        if isinstance(err, CommunicationTimeout):
            why = err.why or ("one may have died, be stuck, or have called another "
                              "collective")  # (before: always this, never the lagging rank)
            reason = f"the other ranks did not reach this call within {comm.timeout:g} s ({why})"
        else:
            reason = f"failed: {err.__cause__ or err}"
        failed = {"failed_rank": err.failed_rank} if isinstance(err, PeerFailedError) else {}
        raise type(err)(f"rank {comm.global_rank}: {kind} {name!r} on group {comm.label}: "
                        f"{reason}", rank=comm.global_rank, group=comm.label,
                        operation=kind, **failed) from err


def exchange_signature(comm: Communicator, kind: str, name: str, tensor: torch.Tensor | None, *,
                       op: int = -1, root: int = -1, rows_may_differ: bool = False,
                       wire: torch.dtype | None = None, joinable: bool = False,
                       refused: Exception | None = None, count: int = -1,
                       scales: tuple[float, float] | None = None,
                       codec: str | None = None) -> list[int]:
    """Exchange this call's signature with the group and raise unless all agree.

    Args:
        comm: the process set's communicator.
        kind: the collective (``"allreduce"``, ``"allgather"`` ...).
        name: the tensor's name (Horovod's ``name=`` or its generated one).
        tensor: the tensor this rank passes.
        op: the reduction, when the collective has one.
        root: the root rank, when it has one.
        rows_may_differ: dim 0 may differ between ranks (allgather, alltoall).
        wire: the dtype sent (after compression); default ``tensor.dtype``.
        joinable: a joined rank can stand in for this call (see :mod:`scaleout.horovod.join`).
        refused: this rank's arguments failed their checks: the error is raised here after the
            exchange, and every other member raises too (nobody waits for this rank).
        count: for the header of a call of several tensors, how many this rank passes (see
            :func:`exchange_count`); ``-1`` for a tensor's own row.
        scales: an allreduce's ``(prescale_factor, postscale_factor)``.
        codec: an allreduce's scaleout codec with its options (``codec_identity``: its
            ``repr``, or its class for a codec that is not a dataclass), ``None`` for
            Horovod's own compressions.

    Returns:
        Every member's dim-0 length, in group-rank order (0 for joined members).

    Raises:
        TypeError, ValueError, NotImplementedError: ``refused``, on this rank.
        CommunicationTimeout: the other members did not reach this call in time (names this
            rank, the group and the call).
        TensorMismatchError: on every member, when any member differs, or when a member has
            joined and this collective is not one a joined rank can stand in for; the message
            names the first such member, or members pass different numbers of tensors
            (``count``).
    """
    if refused is not None or tensor is None:
        mine = [_hash(name), _hash(kind)] + [0] * (_WIDTH - 2)
        mine[_REFUSED] = 1
    else:
        mine = _row(name, kind, op, tensor, root, tensor.dtype if wire is None else wire, joinable,
                    count, scales, codec)
    table = _gather(comm, mine, kind, name) if comm.size > 1 else [mine]
    if refused is not None:
        raise refused
    assert tensor is not None
    for member, row in enumerate(table):
        if row == mine:
            continue
        where = (f"rank {comm.global_rank}: {kind} {name!r} on group {comm.label}: group rank "
                 f"{member} (global rank {comm.ranks[member]})")
        if row[_REFUSED]:
            raise TensorMismatchError(f"{where} refused its arguments to this call and raised "
                                      "(see the error on that rank)")
        if row[_KIND] == _JOINED:
            if mine[_JOINABLE]:
                continue
            raise TensorMismatchError(
                f"{where} has called hvd.join(): while ranks have joined, only allreduce "
                f"(without a scaleout codec) and allgather of tensors up to {_MAX_DIMS}-d can run")
        if row[_KIND] != mine[_KIND]:
            raise TensorMismatchError(f"{where} called a different collective at the same "
                                      f"point (this rank: {kind})")
        if row[_NAME] != mine[_NAME]:
            raise TensorMismatchError(_names_differ(where, kind, name, mine[_AUTO], row[_AUTO]))
        if row[_COUNT] != mine[_COUNT]:
            raise TensorMismatchError(f"{where} passed {row[_COUNT]} tensors to this call, this "
                                      f"rank {count}: every rank must pass the same number")
        if row[_OP] != mine[_OP]:
            raise TensorMismatchError(f"{where}: mismatched reduction ops (op {row[_OP]} there, "
                                      f"{op} here)")
        if row[_ROOT] != mine[_ROOT]:
            raise TensorMismatchError(f"{where}: mismatched root ranks ({row[_ROOT]} there, "
                                      f"{root} here)")
        if row[_DTYPE] != mine[_DTYPE] or row[_WIRE] != mine[_WIRE]:
            raise TensorMismatchError(f"{where}: mismatched data types: {_dtype(row[_DTYPE])} "
                                      f"there, {_dtype(mine[_DTYPE])} here (on the wire: "
                                      f"{_dtype(row[_WIRE])} there, {_dtype(mine[_WIRE])} here)")
        if row[_SCALES] != mine[_SCALES]:
            factors = "" if scales is None else f" (this rank: {scales[0]:g} / {scales[1]:g})"
            raise TensorMismatchError(f"{where}: mismatched prescale_factor / postscale_factor"
                                      f"{factors}: every rank must scale alike")
        if row[_CODEC] != mine[_CODEC]:  # (before: a gloo abort, or each rank its own answer)
            theirs = "no scaleout codec" if not row[_CODEC] else (
                "another scaleout codec or other options" if codec else "a scaleout codec")
            raise TensorMismatchError(f"{where}: mismatched compression: that rank uses {theirs}, "
                                      f"this rank {codec or 'no scaleout codec'}; every rank must "
                                      "pass the same compression")
        same_tail = row[_NDIM] == mine[_NDIM] and row[_DIMS + 1:_SCALES] == mine[_DIMS + 1:_SCALES]
        if not (rows_may_differ and same_tail):
            what = "trailing shapes (dims after the first)" if rows_may_differ else "shapes"
            raise TensorMismatchError(f"{where}: mismatched {what}: {_shape(row)} there, "
                                      f"{_shape(mine)} here")
    return [0 if row[_KIND] == _JOINED else (row[_DIMS] if row[_NDIM] else 1) for row in table]


def exchange_count(comm: Communicator, kind: str, name: str, count: int, *,
                   joinable: bool = False, refused: Exception | None = None) -> None:
    """The header of a call of ``count`` tensors: raise on every member unless all pass as many.

    Args:
        comm, kind, name, refused: as for :func:`exchange_signature`.
        count: how many tensors this rank passes (0 too: the header is exchanged regardless).
        joinable: a joined rank can stand in for the call's tensors; it lets the header pass.

    Raises:
        TensorMismatchError: (on every member) the members pass different numbers of tensors,
            or see :func:`exchange_signature`.
    """
    exchange_signature(comm, kind, name, torch.empty(0), joinable=joinable, refused=refused,
                       count=count)


def exchange_joined(comm: Communicator) -> tuple[Signature | None, list[int]] | None:
    """A joined rank's side of :func:`exchange_signature`.

    Returns:
        ``None`` when every member has joined; else the active members' call (``None`` as
        the signature when they disagree among themselves, or when a joined rank cannot stand
        in for it: they raise, and nothing moves) and every member's dim-0 length.
    """
    row = [0] * _WIDTH
    row[_KIND] = _JOINED
    table = _gather(comm, row, "join", "join")
    active = [r for r in table if r[_KIND] != _JOINED]
    if not active:
        return None
    counts = [0 if r[_KIND] == _JOINED else (r[_DIMS] if r[_NDIM] else 1) for r in table]
    first = active[0]
    signature = _decode(first)
    if signature.kind in GATHERS:  # dim 0 may differ
        agreed = all(r[:_DIMS] == first[:_DIMS] and r[_DIMS + 1:] == first[_DIMS + 1:]
                     for r in active)
    else:
        agreed = all(r == first for r in active)
    if not agreed or signature.kind is None:
        return None, counts
    return signature, counts
