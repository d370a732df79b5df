"""``broadcast_object`` and ``allgather_object`` without pickle on the wire.

Objects travel as ``torch.save`` bytes and are read back with ``torch.load(weights_only=True)``,
which rebuilds only plain data: tensors, numbers, strings, bytes, None, bools, and lists,
tuples, dicts, OrderedDicts and sets of these (the types a state dict is made of), and never
runs code from a peer. Anything else is refused on the sending rank with a TypeError.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from scaleout.core import collectives as coll
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["broadcast_object", "allgather_object", "encode_object", "decode_object"]


def encode_object(obj: Any, operation: str) -> torch.Tensor:
    """``obj`` as a uint8 tensor of ``torch.save`` bytes, checked to load with weights_only.

    Raises:
        TypeError: ``obj`` holds a type that ``torch.load(weights_only=True)`` cannot rebuild.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as err:
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
        name: accepted for Horovod compatibility.
        process_set: the ranks taking part.

    Returns:
        A copy of the root's object (on the root, ``obj`` itself).

    Raises:
        TypeError: (on the root) the object holds a type that cannot travel safely.
        ValueError: ``root_rank`` is not a member of the set.
    """
    comm = process_set.communicator("broadcast_object")
    if root_rank not in comm.ranks:
        raise ValueError(f"broadcast_object: root_rank must be a rank of the process set "
                         f"{list(comm.ranks)}, got {root_rank}")
    root = comm.ranks.index(root_rank)
    is_root = comm.global_rank == root_rank
    payload = encode_object(obj, "broadcast_object") if is_root else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    coll.bcast(comm, length, root).wait()
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    coll.bcast(comm, payload, root).wait()
    return obj if is_root else decode_object(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank of the process set.

    Args:
        obj: this rank's object; see the module docstring for the types.
        name: accepted for Horovod compatibility.
        process_set: the ranks taking part.

    Returns:
        The list of the members' objects (this rank's entry is a decoded copy).

    Raises:
        TypeError: the object holds a type that cannot travel safely.
    """
    comm = process_set.communicator("allgather_object")
    payload = encode_object(obj, "allgather_object")
    lengths = coll.allgather(comm, torch.tensor([payload.numel()], dtype=torch.int64)).wait()
    counts = [int(n) for n in lengths.tolist()]
    gathered = coll.allgatherv(comm, payload, counts).wait()
    return [decode_object(part) for part in gathered.split(counts)]
