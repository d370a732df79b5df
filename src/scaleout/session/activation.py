"""Activation: model-parallel exchanges of a layer's inputs or outputs (MLSL's Activation).

Exchange rules (MLSL): a fully-connected output split across the model group is
reduce-scattered forward and all-gathered backward; a model-parallel -> data-parallel
transition reduce-scatters by minibatch and all-gathers back; other layout changes use
all-to-all. Forward and backward exchanges are the two directions of one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.request import Request, completed_request


__all__ = ["Exchange", "ActivationSpec", "Activation"]


class Exchange(enum.Enum):
    """How an activation crosses the model group (forward direction; backward is the inverse).

    ``NONE``: nothing to exchange. ``REDUCE_SCATTER``: partial sums reduced, each rank keeps
    its row block (backward: all-gather). ``ALLGATHER``: row blocks gathered (backward:
    reduce-scatter). ``ALLTOALL``: row blocks redistributed (backward: all-to-all back).
    ``ALLREDUCE``: partial sums reduced everywhere (backward: nothing, the gradient is
    already replicated).
    """

    NONE = "none"
    REDUCE_SCATTER = "reduce_scatter"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"
    ALLREDUCE = "allreduce"


_BACKWARD = {
    Exchange.NONE: Exchange.NONE, Exchange.REDUCE_SCATTER: Exchange.ALLGATHER,
    Exchange.ALLGATHER: Exchange.REDUCE_SCATTER, Exchange.ALLTOALL: Exchange.ALLTOALL,
    Exchange.ALLREDUCE: Exchange.NONE,
}


@dataclass(frozen=True, kw_only=True)
class ActivationSpec:
    """An input or output of an operation.

    Attributes:
        exchange: the forward exchange over the model group.
        name: for errors.
    """

    exchange: Exchange = Exchange.NONE
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.exchange, Exchange):
            raise TypeError(f"ActivationSpec.exchange must be an Exchange, got {self.exchange!r}")


def _start(exchange: Exchange, comm: Communicator, tensor: torch.Tensor) -> Request:
    if exchange is Exchange.REDUCE_SCATTER:
        return collectives.reduce_scatter(comm, tensor)
    if exchange is Exchange.ALLGATHER:
        return collectives.allgather(comm, tensor)
    if exchange is Exchange.ALLTOALL:
        return collectives.alltoall(comm, tensor)
    if exchange is Exchange.ALLREDUCE:
        return collectives.allreduce(comm, tensor)
    return completed_request(tensor, rank=comm.global_rank, group=comm.label, operation="none")


class Activation:
    """One activation of an operation, exchanged across the model group when needed."""

    def __init__(self, spec: ActivationSpec, comm: Communicator, name: str) -> None:
        self.spec = spec
        self.comm = comm  # the model group of its operation's distribution
        self.name = spec.name or name
        self._forward: Request | None = None
        self._backward: Request | None = None

    @property
    def exchange(self) -> Exchange:
        return self.spec.exchange

    def start_comm(self, tensor: torch.Tensor) -> None:
        """Start the forward exchange of ``tensor`` (row blocks along dim 0)."""
        if self._forward is not None:
            raise RuntimeError(f"start_comm on activation {self.name}: already started")
        self._forward = _start(self.spec.exchange, self.comm, tensor)

    def wait_comm(self, timeout: float | None = None) -> torch.Tensor:
        """The exchanged tensor."""
        if self._forward is None:
            raise RuntimeError(f"wait_comm on activation {self.name}: start_comm was not called")
        request, self._forward = self._forward, None
        return request.wait(timeout)

    def start_grad_comm(self, gradient: torch.Tensor) -> None:
        """Start the backward exchange (the inverse of the forward one) of ``gradient``."""
        if self._backward is not None:
            raise RuntimeError(f"start_grad_comm on activation {self.name}: already started")
        self._backward = _start(_BACKWARD[self.spec.exchange], self.comm, gradient)

    def wait_grad_comm(self, timeout: float | None = None) -> torch.Tensor:
        """The exchanged gradient."""
        if self._backward is None:
            raise RuntimeError(f"wait_grad_comm on activation {self.name}: start_grad_comm "
                               "was not called")
        request, self._backward = self._backward, None
        return request.wait(timeout)
