"""DataParallel's per-layer forward hooks: the update a layer waits for, and its timing.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``_session``,
``_forward_order``, ``updates``, ``_stopwatch``, ``_timed``, ``_first_laps``, ``_handles`` and
``_read_early``); they hold the model weakly (``dp_lifetime``). Before
the first forward commits the session, the pre-hooks record the order the layers run in (it
decides the buckets); after it, each layer's pre-hook completes that layer's update
(cross-iteration overlap: at the latest here). The post-hook times the layer's forward, the
first one's too (into statistics of its own until the session exists), when a backward may
follow it (grad enabled; an evaluation forward is not an iteration's).
:meth:`ForwardHooks._completes` serves a module that reads other layers' parameters before
their own modules run (``scaleout.pytorch.reads``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaleout.pytorch.dp_lifetime import weakly
from scaleout.pytorch.modules import Layer
from scaleout.session import Statistics

__all__ = ["ForwardHooks"]


class ForwardHooks:
    """The forward-side hook factories of DataParallel (see the module docstring)."""

    def _lap_statistics(self) -> Statistics:
        """Where a forward's laps go: the session's statistics, or before the first forward
        built the session, that forward's own (:meth:`_merge_first_laps` adds them after)."""
        return self._first_laps if self._session is None else self._session.statistics

    def _merge_first_laps(self) -> None:
        """Add the first forward's compute to the new session's statistics (its spans are in
        the trace already): its iteration's backward is counted there too."""
        if self._session is not None:
            for name, figures in self._first_laps.as_dict().items():
                if name != "total":
                    self._session.statistics.add(name, compute_s=figures["compute_s"])
        self._first_laps.reset()

    def _pre_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(model: Any, _module: nn.Module, _inputs: Any) -> None:
            if model._session is None:
                if layer not in model._forward_order:
                    model._forward_order.append(layer)
            else:
                model.updates.complete(layer)
            model._stopwatch.restart()
        return torch.compiler.disable(weakly(self, hook))  # (the user's module outlives it)

    def _hook_readers(self, early: list[tuple[nn.Module, list[Layer]]]) -> None:
        """Give each module that read other layers' parameters early (``find_early_reads``)
        a pre-hook completing those layers' updates, once per reader and layer: forwards are
        watched until a training one, and each finds the same reads again (before stop 51
        every watched forward added its hooks: an evaluation pass before training, or a model
        trained in ``eval()``, gained one more hook per reader with each forward)."""
        for reader, layers in early:
            known = self._read_early.setdefault(id(reader), [])
            new = [layer for layer in layers if layer not in known]
            if new:
                known.extend(new)
                self._handles.append(reader.register_forward_pre_hook(self._completes(new)))

    def _completes(self, layers: list[Layer]) -> Callable[..., None]:
        def hook(model: Any, _module: nn.Module, _inputs: Any) -> None:
            if model._session is not None:
                for layer in layers:
                    model.updates.complete(layer)
        return torch.compiler.disable(weakly(self, hook))

    def _post_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(model: Any, _module: nn.Module, _inputs: Any, _output: Any) -> None:
            if model._timed:  # (backward compute is timed from here on)
                model._stopwatch.lap(model._lap_statistics(), layer.name, phase="forward")
            else:
                model._stopwatch.restart()
        return torch.compiler.disable(weakly(self, hook))
