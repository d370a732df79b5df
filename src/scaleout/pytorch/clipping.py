"""``clip_grad_norm_`` over the averaged gradients of a data-parallel model.

:func:`clip_global_norm` clips whole averaged gradients in ``.grad`` (``max_grad_norm`` of a
DistributedOptimizer without the sharded update); :func:`clip_owned_slices` clips the
sharded update's slices of them, which no rank holds whole: each rank's squares of its owned
slices are summed over the data group (one scalar all-reduce), so every rank scales by the
same factor, the one torch's ``clip_grad_norm_`` would take from the whole averaged gradient.
A tensor-parallel shard's gradient (``scaleout.pytorch.placement.is_sharded``) counts once in
the norm through a sum over the model group; a replicated parameter's, the same on every rank
of that group, once as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.placement import is_sharded

__all__ = ["clip_global_norm", "clip_owned_slices"]


def _squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad in tensors:
        total += grad.detach().double().pow(2).sum()
    return total


def _scale(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ rule
    for grad in grads:
        grad.mul_(factor.to(grad.dtype))


def clip_global_norm(params: Sequence[nn.Parameter], max_norm: float,
                     model_comm: Communicator) -> None:
    """``clip_grad_norm_`` over the whole model: every rank of the model group scales by the
    same factor (a per-rank norm clipped each by its own and let the replicated parameters
    drift apart)."""
    if model_comm.size == 1:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    sharded: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    for param in params:
        if param.grad is not None:
            (sharded if is_sharded(param) else whole).append(param.grad)
    grads = sharded + whole
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    parts = _squares(sharded, device).reshape(1)
    # every rank of the model group, with or without gradients of its own (since stop 52; a
    # rank without any returned before this all-reduce, and the others waited out the timeout)
    collectives.allreduce(model_comm, parts).wait()
    if grads:
        _scale(grads, (parts[0] + _squares(whole, device)).sqrt(), max_norm)


def clip_owned_slices(pairs: Sequence[tuple[nn.Parameter, nn.Parameter]], max_norm: float,
                      data_comm: Communicator, model_comm: Communicator) -> None:
    """Clip the sharded update's averaged gradient slices (each ``(weight, shard)``'s
    ``shard.grad``) to ``max_norm``, the global norm of the whole averaged gradient. Every
    rank of the data group calls it at the same step, with or without slices of its own."""
    sharded = [shard.grad for param, shard in pairs
               if shard.grad is not None and is_sharded(param)]
    whole = [shard.grad for param, shard in pairs
             if shard.grad is not None and not is_sharded(param)]
    device = pairs[0][1].device if pairs else torch.device("cpu")
    parts = torch.stack([_squares(sharded, device), _squares(whole, device)])
    collectives.allreduce(data_comm, parts).wait()
    if model_comm.size > 1:
        tensor_parallel = parts[:1].clone()
        collectives.allreduce(model_comm, tensor_parallel).wait()
        parts[0] = tensor_parallel[0]
    _scale(sharded + whole, parts.sum().sqrt(), max_norm)
