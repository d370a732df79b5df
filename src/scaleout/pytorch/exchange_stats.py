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
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from scaleout.core.request import Request

__all__ = ["ExchangeRecorder", "Started", "bind_recorders"]

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
        self._add(sent, spent, spent)
        return result

    def start(self, request: Request) -> Started:
        """Note that ``request`` (an exchange) started now; :meth:`wait` takes the result."""
        started = Started(request=request, at=time.perf_counter())
        if self.statistics is not None:  # when it completed: its communication time
            request.when_done(started.finished)
        return started

    def wait(self, started: Started, sent: torch.Tensor) -> Any:
        """``wait()`` for an exchange that sends ``sent``: the wait counts as exposed, start
        to completion (or to the end of the wait, if later) as communication."""
        began = time.perf_counter()
        result = started.request.wait()
        if self.statistics is not None:
            ended = time.perf_counter()
            done = min(started.done_at or ended, ended)
            self._add(sent, done - started.at, ended - began)
        return result

    def _add(self, sent: torch.Tensor, comm_s: float, exposed_s: float) -> None:
        nbytes = sent.numel() * sent.element_size()
        self.statistics.add(self.operation, comm_s=comm_s, exposed_s=exposed_s, bytes=nbytes,
                            raw_bytes=nbytes)


@dataclass
class Started:
    """An exchange started at ``at`` (``time.perf_counter``), completed at ``done_at``
    (once its completion was reported)."""

    request: Request
    at: float
    done_at: float | None = None

    def finished(self, _: Request) -> None:
        self.done_at = time.perf_counter()


def bind_recorders(module: torch.nn.Module, statistics: Any) -> None:
    """Bind every recorder in ``module`` to ``statistics``, named by its module's path."""
    for name, child in module.named_modules():
        recorder = getattr(child, "exchange_recorder", None)
        if isinstance(recorder, ExchangeRecorder):
            recorder.name = name or "<root>"
            recorder.statistics = statistics
