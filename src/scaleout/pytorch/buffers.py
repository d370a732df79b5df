"""Floating buffers (BatchNorm running statistics) kept equal across the data group.

After every training forward the buffers are averaged over the data group, without blocking:
the result is installed before the next forward (or any synchronisation) reads them.
"""

from __future__ import annotations

import torch
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import Communicator, ReduceOp
from scaleout.core.request import Request

__all__ = ["BufferAverage"]


def floating_buffers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``module``'s floating buffers, each as (the submodule holding it, its name there)."""
    return [(owner, name) for owner in module.modules()
            for name, buffer in owner.named_buffers(recurse=False)
            if buffer is not None and buffer.is_floating_point()]


class BufferAverage:
    """Averages ``buffers`` over ``comm`` (its own communicator: it never queues behind
    gradients).

    Args:
        buffers: the module's floating buffers, as :func:`floating_buffers` gives them: each
            is looked up where it lives at every use, so a buffer that ``module.double()`` or
            ``.to()`` replaced after wrapping is still the one averaged (the tensors captured
            at construction were averaged instead, and the ranks' statistics drifted apart).
        comm: a communicator of the data group.
    """

    def __init__(self, buffers: list[tuple[nn.Module, str]], comm: Communicator) -> None:
        self._where = buffers
        self._comm = comm
        self._request: Request | None = None

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return [owner._buffers[name] for owner, name in self._where]

    def start(self) -> None:
        """Start averaging the buffers' current values (after a training forward), in
        float64: the average of values that agree is then those values again for buffers of
        32 bits or fewer (in their own dtype a constant table moved by ulps at 3 ranks, a
        bf16 one by up to 0.57%, and ``finfo(dtype).min``, the usual mask value, summed to
        -inf). A float64 buffer may move by an ulp at a rank count not a power of two."""
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in self._buffers])
        self._request = collectives.allreduce(self._comm, flat, ReduceOp.AVG)

    def finish(self) -> None:
        """Install the averaged values, if an average is in flight.

        Through ``.data``, which leaves the buffer's ``_version`` alone: a forward whose
        backward has not run yet may have saved it (``batch_norm`` saves its running
        statistics), and a second forward before that backward (two views through one model:
        SimCLR, BYOL, a siamese loss) failed it with autograd's "modified by an inplace
        operation" (since stop 51; torch's own update of the statistics, inside the op, does
        not). That backward never reads them in training mode; a BatchNorm in ``eval()``
        keeps values that agree across ranks, whose average is those values again."""
        if self._request is None:
            return
        flat, self._request = self._request.wait(), None
        offset = 0
        for buffer in self._buffers:
            buffer.data.copy_(flat[offset: offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()
