"""What DataParallel refuses to become after it was built: a converted model and a copy.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``_layers``,
``_session``, ``distributed_update`` and ``updates``).

**Conversions.** ``model.double()``, ``.half()``, ``.to(dtype or device)`` change the
parameters in place. Before the first forward that is fine: the gradient buckets are built
then, from the parameters as they are. After it the buckets keep the old dtype and device,
and so do the sharded update's slices of the weights once its DistributedOptimizer made them:
before stop 52 a ``model.double()`` after the first step failed in the next backward with
"start_gradient_comm on b.bias: expected dtype torch.float32, got torch.float64", and one
after the sharded DistributedOptimizer was built failed in ``step()`` with autograd's
"attempting to assign a gradient with dtype 'double' to a tensor with grad_dtype 'Float'";
now the call itself raises, before it changes anything, and says what to do instead.
Conversions that keep every trained parameter's dtype and device (``.to(memory_format=...)``,
a buffer's dtype) pass.

**Copies.** A DataParallel holds communicators, a progress thread and hooks on its module; a
copy could share none of them. ``copy.deepcopy(model)`` (``AveragedModel(model)``, an EMA
made by copying) and ``pickle`` / ``torch.save(model)`` failed inside ``copy`` with
"cannot pickle 'torch._C._distributed_c10d.TCPStore' object"; now they name the bare module
(``model.module``) to copy and ``state_dict()`` to save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = ["Conversions"]


class Conversions(nn.Module):
    """DataParallel's ``_apply`` (behind ``.to()``, ``.double()``, ...) and its refusal to
    be copied (see the module docstring)."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        fixed = self._fixed_by()
        if fixed is not None:
            for layer in self._layers:
                for param in layer.params:  # (an empty tensor shows where fn would take it)
                    probe = fn(torch.empty(0, dtype=param.dtype, device=param.device))
                    if probe.dtype != param.dtype or probe.device != param.device:
                        name = next((n for n, p in self.module.named_parameters() if p is param),
                                    "(one no longer in model.module)")
                        raise RuntimeError(
                            f"DataParallel: this conversion would make parameter {name} "
                            f"{probe.dtype} on {probe.device} (it is {param.dtype} on "
                            f"{param.device}) after {fixed} kept its dtype and device. "
                            f"Convert the model (.double(), .half(), .to(...)) before the "
                            f"first forward and before building the DistributedOptimizer, or "
                            f"wrap the converted module (model.module) in a new DataParallel")
        return super()._apply(fn, recurse)

    def _fixed_by(self) -> str | None:
        """What keeps the parameters' dtype and device, or ``None`` while nothing does."""
        if self._session is not None:
            return "the first forward built the gradient buckets, which"
        if self.distributed_update and self.updates.updater is not None:
            return "the sharded update's DistributedOptimizer copied this rank's slices, which"
        return None

    def __getstate__(self) -> NoReturn:
        raise TypeError(
            "a DataParallel cannot be copied or pickled: it holds communicators, a progress "
            "thread and hooks on its module. Copy the bare module instead (copy.deepcopy("
            "model.module), AveragedModel(model.module)) and save model.state_dict() (or "
            "scaleout.checkpoint.save) rather than the model object")

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        self.__getstate__()
