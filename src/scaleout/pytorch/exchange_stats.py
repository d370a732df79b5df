"""Per-layer statistics of activation exchanges (model-parallel layers, sharded tables).

A layer that exchanges activations owns an :class:`ExchangeRecorder`; DataParallel binds
it to its session's :class:`~scaleout.session.Statistics` at the first forward, under the
operation name ``"<layer> (activations)"``. Each exchange adds its time (the wait blocks
the training loop, so it counts as communication and as exposed time) and the bytes this
rank sent, the same figures gradient exchanges report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["ExchangeRecorder", "bind_recorders"]

_T = TypeVar("_T")


class ExchangeRecorder:
    """Times and counts one layer's activation exchanges (nothing until bound).

    Args:
        name: the layer's name.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.statistics: Any = None

    @property
    def operation(self) -> str:
        return f"{self.name or '(unnamed)'} (activations)"

    def run(self, sent: torch.Tensor, exchange: Callable[[], _T]) -> _T:
        """Run ``exchange()`` (which sends ``sent``), recording its time and bytes."""
        if self.statistics is None:
            return exchange()
        began = time.perf_counter()
        result = exchange()
        spent = time.perf_counter() - began
        nbytes = sent.numel() * sent.element_size()
        self.statistics.add(self.operation, comm_s=spent, exposed_s=spent, bytes=nbytes,
                            raw_bytes=nbytes)
        return result


def bind_recorders(module: torch.nn.Module, statistics: Any) -> None:
    """Bind every recorder in ``module`` to ``statistics``, named by its module's path."""
    for name, child in module.named_modules():
        recorder = getattr(child, "exchange_recorder", None)
        if isinstance(recorder, ExchangeRecorder):
            recorder.name = name or "<root>"
            recorder.statistics = statistics
