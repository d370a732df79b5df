"""``broadcast_object`` and ``allgather_object`` without pickle on the wire.

Objects travel as ``torch.save`` bytes and are read back with ``torch.load(weights_only=True)``,
which rebuilds only plain data: tensors, numbers, strings, bytes, None, bools, and lists,
tuples, dicts, OrderedDicts and sets of these (the types a state dict is made of), and never
runs code from a peer. Anything else is refused on the sending rank with a TypeError.

Both first exchange a signature (see :mod:`scaleout.horovod.signature`), as the other
collectives do: a rank that has called ``hvd.join()`` reads it and refuses, so that every
rank raises instead of waiting for it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from scaleout.core import collectives as coll
from scaleout.core.consistency import control_tensor
from scaleout.horovod.context import runtime
from scaleout.horovod.process_sets import ProcessSet, global_process_set, root_index
from scaleout.horovod.signature import attempt, exchange_signature

__all__ = ["broadcast_object", "allgather_object", "encode_object", "decode_object"]


def encode_object(obj: Any, operation: str) -> torch.Tensor:
    """``obj`` as a uint8 tensor of ``torch.save`` bytes, checked to load with weights_only.

    Raises:
        TypeError: ``obj`` holds a type that ``torch.load(weights_only=True)`` cannot rebuild.
    """
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        data = buffer.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.PicklingError, pickle.UnpicklingError, RuntimeError, AttributeError,
            TypeError) as err:
        raise TypeError(
            f"{operation}: cannot send an object of type {type(obj).__name__} safely: only "
            "tensors, numbers, strings, bytes, None and lists/tuples/dicts/sets of them travel "
            f"(received objects are loaded with torch.load(weights_only=True)): {err}") from err
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_object(payload: torch.Tensor) -> Any:
    """The object :func:`encode_object` encoded (loaded with ``weights_only=True``)."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Rank ``root_rank``'s ``obj`` on every rank of the process set.

    Args:
        obj: the object (read on the root only); see the module docstring for the types.
        root_rank: the global rank that sends.
        name: the call's name; ranks must pass the same (default: generated, in call order).
        process_set: the ranks taking part.

    Returns:
        A copy of the root's object (on the root, ``obj`` itself).

    Raises:
        TypeError: (on every rank) the root's object holds a type that cannot travel safely.
        TypeError: ``root_rank`` is not an int.
        ValueError: ``root_rank`` is not a member of the set.
        TensorMismatchError: (on every rank) the ranks disagree on the name or the root, or
            called another collective, or a rank has called ``hvd.join()``.
    """
    kind = "broadcast_object"
    comm = process_set.communicator(kind)
    name = runtime().auto_name(kind, name, process_set)

    # (before stop 52 any value equal to a rank passed: root_rank="0" was refused as "got 0",
    # True and 1.0 were taken for rank 1)
    root, refused = attempt(lambda: root_index(comm, root_rank, kind))
    exchange_signature(comm, kind, name, torch.empty(0), root=-1 if root is None else root,
                       refused=refused)
    is_root = comm.global_rank == root_rank
    payload, failure = None, None
    if is_root:
        try:
            payload = encode_object(obj, "broadcast_object")
        except TypeError as err:
            failure = err
    # the length, or -1 when the root cannot send: then every rank raises, none waits
    length = control_tensor(comm, [payload.numel() if payload is not None else -1])
    coll.bcast(comm, length, root).wait()
    if failure is not None:
        raise failure
    if length.item() < 0:
        raise TypeError(f"broadcast_object: root rank {root_rank} could not send its object "
                        "(see the error there)")
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    payload = payload.to(length.device)  # (where the group carries it: NCCL's GPU)
    coll.bcast(comm, payload, root).wait()
    return obj if is_root else decode_object(payload.cpu())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank of the process set.

    Args:
        obj: this rank's object; see the module docstring for the types.
        name: the call's name; ranks must pass the same (default: generated, in call order).
        process_set: the ranks taking part.

    Returns:
        The list of the members' objects (this rank's entry is a decoded copy).

    Raises:
        TypeError: (on every rank) some rank's object holds a type that cannot travel safely.
        TensorMismatchError: (on every rank) the ranks disagree on the name, or called another
            collective, or a rank has called ``hvd.join()``.
    """
    kind = "allgather_object"
    comm = process_set.communicator(kind)
    exchange_signature(comm, kind, runtime().auto_name(kind, name, process_set), torch.empty(0))
    payload, failure = None, None
    try:
        payload = encode_object(obj, "allgather_object")
    except TypeError as err:
        failure = err
    # every length, -1 for a rank that cannot send: then every rank raises, none waits
    mine = control_tensor(comm, [payload.numel() if payload is not None else -1])
    counts = [int(n) for n in coll.allgather(comm, mine).wait().tolist()]
    if failure is not None:
        raise failure
    if min(counts) < 0:
        failed = [comm.ranks[i] for i, n in enumerate(counts) if n < 0]
        raise TypeError(f"allgather_object: ranks {failed} could not send their objects "
                        "(see the errors there)")
    assert payload is not None
    gathered = coll.allgatherv(comm, payload.to(mine.device), counts).wait().cpu()
    return [decode_object(part) for part in gathered.split(counts)]
