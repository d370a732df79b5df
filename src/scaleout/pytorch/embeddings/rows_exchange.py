"""Step 4 of the collection's forward: the looked-up rows go back to the samples' ranks.

An alltoallv whose backward is the reverse alltoallv of the rows' gradients, divided by the
data group's size (DataParallel's average); the gradients then reach the tables as sparse
row gradients through the lookups' own backward.
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started

__all__ = ["exchange_rows"]


def exchange_rows(rows: torch.Tensor, comm: Communicator, send: list[int], recv: list[int],
                  divisor: int, recorder: ExchangeRecorder,
                  started: Started | None = None) -> torch.Tensor:
    """Send ``send[j]`` of ``rows`` to rank ``j``, receive ``recv[i]`` from rank ``i``.

    Args:
        rows: this rank's lookups for every rank, side by side (in the tables' graph).
        comm: the data group. divisor: its size (the gradients' average).
        recorder: records both exchanges.
        started: the forward exchange when it was started already (the rows were looked up
            and sent ahead, :meth:`EmbeddingCollection.start_lookup`): only waited for.

    Returns:
        The rows this rank asked for, in the autograd graph.
    """
    return _Exchange.apply(rows, comm, send, recv, divisor, recorder, started)


class _Exchange(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, comm: Communicator, send: list[int],
                recv: list[int], divisor: int, recorder: ExchangeRecorder,
                started: Started | None) -> torch.Tensor:
        ctx.args = (comm, send, recv, divisor, recorder)
        if started is not None:
            return recorder.wait(started, rows)
        return recorder.run(rows, lambda: collectives.alltoallv(comm, rows, send, recv).wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        comm, send, recv, divisor, recorder = ctx.args
        grad = grad.contiguous()
        back = recorder.run(grad, lambda: collectives.alltoallv(comm, grad, recv, send).wait())
        return collectives.average_into(back, back, divisor), *[None] * 6
