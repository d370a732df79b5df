"""The wrapped module's own entry points, as DDP scripts call them on one rank: they see the
weights and buffers every rank agrees on.

DDP's idioms reach past the wrapper: ``if rank == 0: torch.save(model.module.state_dict(),
path)``, ``model.module.eval(); model.module(x_val)``, ``model.module.load_state_dict(...)``.
Under DataParallel an update requested by ``step()`` (overlap mode, the sharded update's
gathered values) lands in the next forward, and the buffers' average (BatchNorm's running
statistics) is installed before the next forward too. So hooks on the bare module finish
them first (since stop 52):

- ``module.state_dict()`` finishes pending updates and the buffer average (``synchronize()``,
  which only waits for exchanges every rank started: safe on one rank). Before, rank 0 saved
  the weights of the step before in overlap mode (0.052 off after the third step of a small
  CNN) and, in every mode, its own running statistics instead of the average (0.022 off in
  sync mode); every rank loading that file then trained on from them.
- ``module.load_state_dict()`` does the same first, so the loaded values are not overwritten
  by (or refused for) an update still in flight.
- ``module(x)`` installs the buffers' average first: an evaluation through the bare module
  read this rank's running statistics (0.011 off on a BatchNorm CNN's logits); the layers'
  own pre-hooks already completed their updates.

Each hook holds the model weakly (``dp_lifetime``) and is removed with the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaleout.pytorch.dp_lifetime import weakly

__all__ = ["hook_bare_module"]


def _synchronize(model: Any, *_: Any) -> None:
    model.synchronize()


def _finish_buffers(model: Any, *_: Any) -> None:
    if model._session is not None:
        model._finish_buffers()


def hook_bare_module(model: Any, module: nn.Module) -> list[Any]:
    """Hooks on ``module`` (the model's wrapped module) that let its ``state_dict()``,
    ``load_state_dict()`` and forward see what every rank agrees on; their handles."""
    return [module.register_state_dict_pre_hook(weakly(model, _synchronize)),
            module.register_load_state_dict_pre_hook(weakly(model, _synchronize)),
            module.register_forward_pre_hook(
                torch.compiler.disable(weakly(model, _finish_buffers)))]
