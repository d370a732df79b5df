"""Refuse another optimizer's step over parameters a sharded update leaves without gradient.

With ``DataParallel(distributed_update=True)`` each rank receives only its owned slice of
every averaged gradient (a reduce-scatter), and its :class:`DistributedOptimizer` updates
those slices. A trainable parameter that this optimizer does not hold is left as it is (a
frozen parameter: right), but a second, plain optimizer stepping it would find no ``.grad``
and skip it: training that silently does nothing. torch's global optimizer step pre-hook
sees every step; it is registered once, the first time such a model has parameters outside
its optimizer, and costs one lookup per step while none is alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["watch_outside_steps"]

_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()  # sharded DistributedOptimizers
_registered = False


def watch_outside_steps(optimizer: Any) -> None:
    """Refuse, from now on, any other optimizer's step over a parameter that ``optimizer``
    (a sharded DistributedOptimizer) leaves outside."""
    global _registered
    _WATCHED.add(optimizer)
    if not _registered:
        register_optimizer_step_pre_hook(_check_step)
        _registered = True


def _check_step(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for watched in list(_WATCHED):
        if stepped is watched or stepped is watched.inner:
            continue
        outside = watched.model.updates.outside
        for group in stepped.param_groups:
            for param in group["params"]:
                if id(param) in outside:
                    names = {id(p): n for n, p in watched.model.module.named_parameters()}
                    raise ValueError(
                        f"{type(stepped).__name__}.step() over {names.get(id(param), 'a parameter')}"
                        f" of a DataParallel(distributed_update=True) model whose "
                        f"DistributedOptimizer does not hold it: with the sharded update each "
                        f"rank receives only a slice of its averaged gradient, so this optimizer "
                        f"would find none and skip it. Give every trained parameter to the "
                        f"DistributedOptimizer (param groups may differ in options), or "
                        f"distributed_update=False")
