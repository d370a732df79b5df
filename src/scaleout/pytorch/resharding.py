"""Re-partitioning the sharded update's optimizer state for another world size.

With ``DataParallel(distributed_update=True)`` each rank's optimizer holds state (momentum,
Adam's moments) only for its owned slice of every parameter: the flattened parameter cut
into ``ceil(numel / N)``-element blocks (:func:`~scaleout.session.parameter_set.owned_range`).
:func:`consolidate_optimizer_state` joins N ranks' ``state_dict()``\\ s into the state of an
unsharded optimizer (every per-element tensor at its parameter's shape); :func:`split_optimizer_state`
cuts such a state into one rank's slices at another size M. Scalar state (Adam's ``step``)
is the same on every rank and is kept as is. Both work on plain ``state_dict()`` structures
(``{"state": {index: {...}}, "param_groups": [...]}``), so an unsharded checkpoint can also be
loaded into a sharded optimizer and back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from scaleout.session.parameter_set import owned_range

__all__ = ["consolidate_optimizer_state", "split_optimizer_state", "optimizer_shapes",
           "SCALAR_STATE", "shard_group"]

Shape = tuple[int, ...]


def optimizer_shapes(optimizer: torch.optim.Optimizer) -> list[Shape]:
    """The full shape of each parameter, in the order of the optimizer's state indices (a
    DistributedOptimizer answers for its model's parameters, not for its owned slices)."""
    shapes = getattr(optimizer, "parameter_shapes", None)
    if callable(shapes):
        return [tuple(s) for s in shapes()]
    return [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]]


def shard_group(optimizer: torch.optim.Optimizer | None) -> tuple[int, int] | None:
    """``(size, rank)`` of the group a sharded DistributedOptimizer splits its state over;
    None for an unsharded optimizer."""
    if optimizer is None or not getattr(optimizer, "sharded", False):
        return None
    comm = optimizer.model.comm  # type: ignore[attr-defined]
    return comm.size, comm.rank


def _valid(numel: int, size: int, rank: int) -> tuple[int, int]:
    """``(offset, elements)`` of ``rank``'s owned slice that exist."""
    start, count = owned_range(numel, size, rank)
    return start, max(min(count, numel - start), 0)


def consolidate_optimizer_state(states: Sequence[Mapping[str, Any]], shapes: Sequence[Shape]
                                ) -> dict[str, Any]:
    """Join the ``state_dict()`` of every rank of a sharded update into an unsharded one.

    Args:
        states: rank 0's, rank 1's, ... state dicts (``len(states)`` is the group size).
        shapes: each parameter's full shape, in state-index order.

    Returns:
        A state dict for an unsharded optimizer over the same parameters.

    Raises:
        ValueError: a parameter has state on some ranks only, a slice has the wrong size, or
            scalar state differs between ranks.
    """
    size = len(states)
    joined: dict[int, dict[str, Any]] = {}
    for index, shape in enumerate(shapes):
        per_rank = [s["state"].get(index) for s in states]
        if all(entry is None for entry in per_rank):
            continue  # never updated (an unused parameter)
        if any(entry is None for entry in per_rank):
            missing = [r for r, entry in enumerate(per_rank) if entry is None]
            raise ValueError(f"optimizer state of parameter {index} is missing on ranks "
                             f"{missing} of {size}")
        numel = math.prod(shape)
        sizes = [_valid(numel, size, r)[1] for r in range(size)]
        joined[index] = {}
        for key, first in per_rank[0].items():
            values = [entry[key] for entry in per_rank]
            sliced = isinstance(first, torch.Tensor) and first.dim() == 1 and all(
                isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n
                for v, n in zip(values, sizes))
            if sliced:
                joined[index][key] = torch.cat(values).view(shape)
            elif isinstance(first, torch.Tensor) and first.dim() >= 1:
                raise ValueError(f"optimizer state {key!r} of parameter {index}: slices of "
                                 f"{[tuple(v.shape) for v in values]} elements do not make a "
                                 f"{tuple(shape)} parameter split over {size} ranks")
            elif not all(_equal(first, v) for v in values[1:]):
                raise ValueError(f"optimizer state {key!r} of parameter {index} differs between "
                                 f"ranks: {values}")
            else:
                joined[index][key] = first
    return {"state": joined, "param_groups": [dict(g) for g in states[0]["param_groups"]]}


#: the per-parameter scalars in the state of the optimizers a sharded update takes
#: (``sharded_update.ELEMENTWISE``): Adam's ``step``, ASGD's ``eta`` and ``mu``, NAdam's
#: ``mu_product``; every other tensor there holds one value per element
SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})


def split_optimizer_state(state: Mapping[str, Any], shapes: Sequence[Shape], size: int,
                          rank: int) -> dict[str, Any]:
    """This rank's part of an unsharded ``state`` for a sharded update over ``size`` ranks.

    Tensors shaped like their parameter become the rank's owned slice (a copy); anything else
    (Adam's ``step``) is kept. A 0-dim parameter's per-element state is 0-dim like its
    scalars: there the names in :data:`SCALAR_STATE` tell them apart.
    """
    sliced: dict[int, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        shape = tuple(shapes[index])
        start, count = _valid(math.prod(shape), size, rank)
        sliced[index] = {
            key: value.reshape(-1)[start: start + count].clone()
            if isinstance(value, torch.Tensor) and tuple(value.shape) == shape
            and (value.dim() >= 1 or key not in SCALAR_STATE)
            else value
            for key, value in entry.items()}
    return {"state": sliced, "param_groups": [dict(g) for g in state["param_groups"]]}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)
