"""``broadcast_parameters`` and ``broadcast_optimizer_state``: start every rank from rank 0's model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from scaleout.horovod.collectives import broadcast_async_
from scaleout.horovod.handles import synchronize
from scaleout.horovod.objects import broadcast_object
from scaleout.horovod.process_sets import ProcessSet, global_process_set
from scaleout.horovod.signature import attempt, exchange_count

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def _items(params: object) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        # (name, tensor) pairs, or tensors (model.parameters()), named by their position
        items = [entry if isinstance(entry, tuple) else (str(i), entry)
                 for i, entry in enumerate(params)]
        bad = next((entry for entry in items if len(entry) != 2), None)
        if bad is not None:
            raise ValueError("broadcast_parameters: expected a state dict, (name, tensor) pairs "
                             f"or tensors, got a tuple of {len(bad)} items")
    else:
        raise ValueError(f"broadcast_parameters: expected a state dict, (name, tensor) pairs or "
                         f"tensors, got {type(params).__name__}")
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(value).__name__}, "
                             "expected a tensor")
    return items


def broadcast_parameters(params: Mapping[str, torch.Tensor] |
                         Iterable[tuple[str, torch.Tensor] | torch.Tensor],
                         root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with global rank ``root_rank``'s values.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` (name, tensor pairs) or
            ``model.parameters()`` (tensors).
        root_rank: the rank whose values win.
        process_set: the ranks taking part.

    Raises:
        ValueError: ``params`` is neither a mapping nor name-tensor pairs nor tensors.
        TensorMismatchError: (on every rank) the ranks' models differ in the number of
            entries, names, shapes or dtypes, or another rank's ``params`` were refused.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    kind = "broadcast_parameters"
    items, refused = attempt(lambda: _items(params))
    # every rank passes as many entries (or every rank raises), before any entry moves
    exchange_count(process_set.communicator(kind), kind, kind, len(items or ()), refused=refused)
    handles = []
    for name, value in items:
        target = value.data if isinstance(value, torch.nn.Parameter) else value
        handles.append(broadcast_async_(target, root_rank, f"parameter.{name}", process_set))
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters.

    The root's ``optimizer.state_dict()`` travels as one object (tensors, numbers and
    containers, loaded with ``weights_only=True``) and is loaded on the other ranks;
    parameter groups must have the same layout on every rank.

    Args:
        optimizer: a torch optimizer, or a :class:`DistributedOptimizer`.
        root_rank: the rank whose state wins.
        process_set: the ranks taking part.

    Raises:
        TypeError: ``optimizer`` has no ``state_dict``/``load_state_dict``, or its state holds
            a type that cannot travel safely.
        ValueError: the loaded state does not fit this rank's parameter groups (the other
            ranks raise TensorMismatchError, naming it).
    """
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "load_state_dict")):
        raise TypeError(f"broadcast_optimizer_state: expected a torch optimizer, got "
                        f"{type(optimizer).__name__}")
    mine: Any = optimizer.state_dict()
    state = broadcast_object(mine, root_rank, "optimizer_state", process_set)
    _, refused = (None, None) if state is mine else \
        attempt(lambda: optimizer.load_state_dict(state))
    # a rank whose parameter groups do not fit the root's raises, and so does every other
    # (before: that rank alone, the root went on to wait for it in its next collective)
    exchange_count(process_set.communicator("broadcast_optimizer_state"),
                   "broadcast_optimizer_state", "optimizer_state.loaded", 0, refused=refused)
