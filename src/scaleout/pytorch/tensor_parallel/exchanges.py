"""The four activation exchanges of tensor parallelism, as autograd functions on a model group.

Each takes an optional :class:`~scaleout.pytorch.exchange_stats.ExchangeRecorder` that
reports the exchange to the layer's Statistics. Each is one of MLSL's Activation exchange rules (REFERENCES.md §1) with its backward the
inverse exchange; every collective is a core collective on the model group's
:class:`~scaleout.core.collectives.Communicator` and every wait is bounded by its timeout.

=====================  ==============================  ==============================
function               forward                         backward
=====================  ==============================  ==============================
``copy_to_model``      identity (input replicated)     allreduce of the partial grads
``reduce_from_model``  allreduce of partial sums       identity (grad replicated)
``gather_from_model``  allgather along the last dim    keep this rank's block
``scatter_to_model``   keep this rank's block          allgather along the last dim
=====================  ==============================  ==============================
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.exchange_stats import ExchangeRecorder

__all__ = ["copy_to_model", "reduce_from_model", "gather_from_model", "scatter_to_model",
           "last_dim_block"]


def _allreduce(comm: Communicator, tensor: torch.Tensor, recorder: ExchangeRecorder) -> torch.Tensor:
    buffer = tensor.contiguous().clone()
    return recorder.run(buffer, lambda: collectives.allreduce(comm, buffer).wait())


def _allgather_last(comm: Communicator, tensor: torch.Tensor,
                    recorder: ExchangeRecorder) -> torch.Tensor:
    send = tensor.contiguous().unsqueeze(0)
    gathered = recorder.run(send, lambda: collectives.allgather(comm, send).wait())
    return torch.cat(gathered.unbind(0), dim=-1)


def last_dim_block(comm: Communicator, tensor: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's equal block of ``tensor``'s last dimension.

    Raises:
        ValueError: the last dimension does not divide by the group size.
    """
    width = tensor.shape[-1]
    if width % comm.size:
        raise ValueError(f"{what}: the last dimension ({width}) must be divisible by the model "
                         f"group size {comm.size}")
    part = width // comm.size
    return tensor.narrow(-1, comm.rank * part, part).contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator,
                recorder: ExchangeRecorder) -> torch.Tensor:
        ctx.comm, ctx.recorder = comm, recorder
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _allreduce(ctx.comm, grad, ctx.recorder), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator,
                recorder: ExchangeRecorder) -> torch.Tensor:
        return _allreduce(comm, tensor, recorder)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator,
                recorder: ExchangeRecorder) -> torch.Tensor:
        ctx.comm = comm
        return _allgather_last(comm, tensor, recorder)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return last_dim_block(ctx.comm, grad, "gather_from_model backward"), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Communicator,
                recorder: ExchangeRecorder) -> torch.Tensor:
        ctx.comm, ctx.recorder = comm, recorder
        return last_dim_block(comm, tensor, "scatter_to_model")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _allgather_last(ctx.comm, grad, ctx.recorder), None, None


def copy_to_model(tensor: torch.Tensor, comm: Communicator,
                  recorder: ExchangeRecorder | None = None) -> torch.Tensor:
    """Enter a model-parallel region: identity forward, allreduce of the gradient backward."""
    return _Copy.apply(tensor, comm, recorder or ExchangeRecorder()) if comm.size > 1 else tensor


def reduce_from_model(tensor: torch.Tensor, comm: Communicator,
                      recorder: ExchangeRecorder | None = None) -> torch.Tensor:
    """Leave it by summing partial results: allreduce forward, identity backward."""
    return _Reduce.apply(tensor, comm, recorder or ExchangeRecorder()) if comm.size > 1 else tensor


def gather_from_model(tensor: torch.Tensor, comm: Communicator,
                      recorder: ExchangeRecorder | None = None) -> torch.Tensor:
    """Leave it by concatenating blocks of the last dim: allgather forward, split backward."""
    return _Gather.apply(tensor, comm, recorder or ExchangeRecorder()) if comm.size > 1 else tensor


def scatter_to_model(tensor: torch.Tensor, comm: Communicator,
                     recorder: ExchangeRecorder | None = None) -> torch.Tensor:
    """Enter it by keeping this rank's block of the last dim: split forward, allgather backward."""
    return _Scatter.apply(tensor, comm, recorder or ExchangeRecorder()) if comm.size > 1 else tensor
