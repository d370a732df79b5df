"""DataParallel's per-layer forward hooks: the update a layer waits for, and its timing.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``_session``,
``_forward_order``, ``updates`` and ``_stopwatch``). Before the first forward commits the
session, the pre-hooks record the order the layers run in (it decides the buckets); after
it, each layer's pre-hook completes that layer's update (cross-iteration overlap: at the
latest here) and the post-hook times its forward. :meth:`ForwardHooks._completes` serves a
module that reads other layers' parameters before their own modules run
(``scaleout.pytorch.reads``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaleout.pytorch.modules import Layer

__all__ = ["ForwardHooks"]


class ForwardHooks:
    """The forward-side hook factories of DataParallel (see the module docstring)."""

    def _pre_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self._session is None:
                if layer not in self._forward_order:
                    self._forward_order.append(layer)
                return
            self.updates.complete(layer)
            self._stopwatch.restart()
        return torch.compiler.disable(hook)

    def _completes(self, layers: list[Layer]) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self._session is not None:
                for layer in layers:
                    self.updates.complete(layer)
        return torch.compiler.disable(hook)

    def _post_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            if self._session is not None:  # (backward compute is timed from here on)
                self._stopwatch.lap(self._session.statistics, layer.name, phase="forward")
            else:
                self._stopwatch.restart()
        return torch.compiler.disable(hook)
