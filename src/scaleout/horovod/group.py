"""One handle for several tensors: the machinery of Horovod's ``grouped_*`` collectives.

A grouped call first exchanges a header (how many tensors each member passes, see
:func:`scaleout.horovod.signature.exchange_count`), then starts one collective per tensor,
named ``<name>.<i>`` (or automatically), and returns one handle whose ``synchronize`` gives
the list of outputs, in the order of the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from scaleout.horovod.context import Runtime, runtime
from scaleout.horovod.handles import Pending, submit
from scaleout.horovod.process_sets import ProcessSet
from scaleout.horovod.signature import attempt, exchange_count

__all__ = ["start_group", "run_group"]

#: starts one tensor's collective: (runtime, tensor, its name or None) -> its pending operation
Start = Callable[[Runtime, torch.Tensor, "str | None"], Pending]


def _count(tensors: object, kind: str) -> int:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{kind}: tensors must be a list of tensors, got {type(tensors).__name__}")
    return len(tensors)


def start_group(tensors: object, name: str | None, process_set: ProcessSet,
                kind: str = "grouped_allreduce", joinable: bool = True) -> None:
    """Check that ``tensors`` is a list and that every member passes as many tensors.

    Args:
        tensors: what the caller passed.
        name: the group's name (``None``: the header is named after ``kind``).
        process_set: the members.
        kind: the grouped collective, for the header and the messages.
        joinable: a joined rank can stand in for the group's tensors.

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
        TensorMismatchError: (on every member) the members pass different numbers of tensors,
            or another member's ``tensors`` is not a list.
    """
    count, refused = attempt(lambda: _count(tensors, kind))
    exchange_count(process_set.communicator(kind), kind, name or kind,
                   count if count is not None else 0, joinable=joinable, refused=refused)


def run_group(tensors: Sequence[torch.Tensor], start: Start, name: str | None,
              process_set: ProcessSet, kind: str, joinable: bool = True) -> int:
    """Exchange the header, start ``start`` on each tensor and return one handle for all.

    Tensor ``i`` is named ``<name>.<i>`` (automatically when ``name`` is None); the handle's
    ``synchronize`` returns the list of the outputs.

    Raises:
        TypeError, TensorMismatchError: see :func:`start_group`, and what ``start`` raises.
    """
    rt = runtime()
    start_group(tensors, name, process_set, kind, joinable)
    parts = [start(rt, t, None if name is None else f"{name}.{i}") for i, t in enumerate(tensors)]
    sizes = [len(part.requests) for part in parts]

    def finish(results: list[Any]) -> list[Any]:
        outputs, at = [], 0
        for part, size in zip(parts, sizes):
            outputs.append(part.finish(results[at:at + size]))
            at += size
        return outputs

    requests = [request for part in parts for request in part.requests]
    return submit(rt, Pending(kind=kind, name=name or kind, requests=requests, finish=finish,
                              keys=tuple(key for part in parts for key in part.keys)))
