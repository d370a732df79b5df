"""Spatial parallelism: a sample's height split across the model group (MLPerf HPC, CosmoFlow).

Rank ``r`` of a model group of ``p`` holds rows ``[r H/p, (r+1) H/p)`` of every ``(N, C, H, W)``
activation (for 3-D, ``(N, C, D, H, W)`` split along D). Pooling whose window tiles a rank's
block (``nn.MaxPool2d(2)`` on an even block) needs no exchange and runs as is. A
``SpatialConv`` first exchanges halos: the ``k // 2`` boundary rows go to
the neighbours above and below (one alltoallv on the model group, counts zero elsewhere),
then convolves its rows plus halos, giving exactly its rows of the unsplit convolution.
Backward sends the halos' gradients back the same way and sums each rank's weight gradient
over the group (``copy_to_model``). Pooling and normalisation that follow the split are in
:mod:`scaleout.pytorch.spatial.norm`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.exchange_stats import ExchangeRecorder
from scaleout.pytorch.tensor_parallel.exchanges import copy_to_model

__all__ = ["SpatialConv", "split_rows", "halo_exchange"]


def _neighbours(comm: Communicator, halo: int) -> tuple[list[int], list[int]]:
    counts = [0] * comm.size
    if comm.rank > 0:
        counts[comm.rank - 1] = halo
    if comm.rank < comm.size - 1:
        counts[comm.rank + 1] = halo
    return counts, list(counts)


class _Halo(torch.autograd.Function):
    """``(N, C, h, W)`` -> ``(N, C, h + 2 halo, W)`` with the neighbours' rows (zeros at edges)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, halo: int,
                recorder: ExchangeRecorder) -> torch.Tensor:
        ctx.comm, ctx.halo, ctx.recorder = comm, halo, recorder
        rows = x.movedim(2, 0)  # (h, N, C, W): the core collectives split dim 0
        send, recv = _neighbours(comm, halo)
        parts = []
        if comm.rank > 0:
            parts.append(rows[:halo])  # my top rows: the bottom halo of the rank above
        if comm.rank < comm.size - 1:
            parts.append(rows[-halo:])
        sent = torch.cat(parts)
        got = recorder.run(sent, lambda: collectives.alltoallv(comm, sent, send, recv).wait())
        zeros = rows.new_zeros((halo, *rows.shape[1:]))
        above = got[:halo] if comm.rank > 0 else zeros
        below = got[-halo:] if comm.rank < comm.size - 1 else zeros
        return torch.cat([above, rows, below]).movedim(0, 2).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        comm, halo = ctx.comm, ctx.halo
        rows = grad.movedim(2, 0)
        send, recv = _neighbours(comm, halo)
        parts = []
        if comm.rank > 0:
            parts.append(rows[:halo])  # gradient of the rows the rank above sent me
        if comm.rank < comm.size - 1:
            parts.append(rows[-halo:])
        sent = torch.cat(parts)
        got = ctx.recorder.run(sent, lambda: collectives.alltoallv(comm, sent, send, recv).wait())
        inner = rows[halo: rows.shape[0] - halo].clone()
        if comm.rank > 0:
            inner[:halo] += got[:halo]
        if comm.rank < comm.size - 1:
            inner[-halo:] += got[-halo:]
        return inner.movedim(0, 2).contiguous(), None, None, None


def halo_exchange(x: torch.Tensor, comm: Communicator, halo: int,
                  recorder: ExchangeRecorder | None = None) -> torch.Tensor:
    """``x`` (this rank's rows, dim 2) extended by ``halo`` rows of each neighbour."""
    if halo == 0:
        return x
    if comm.size == 1:
        return F.pad(x, (0, 0, halo, halo))
    if x.shape[2] < halo:
        raise ValueError(f"halo_exchange: each rank must hold at least {halo} rows, got "
                         f"{x.shape[2]}")
    return _Halo.apply(x, comm, halo, recorder or ExchangeRecorder())


def split_rows(x: torch.Tensor, distribution: Distribution) -> torch.Tensor:
    """This rank's block of ``x``'s height (dim 2) on the model group.

    Raises:
        ValueError: the height does not divide by the model group size.
    """
    comm = distribution.communicator(GroupType.MODEL)
    height = x.shape[2]
    if height % comm.size:
        raise ValueError(f"split_rows: height {height} must be divisible by the model group "
                         f"size {comm.size}")
    part = height // comm.size
    return x.narrow(2, comm.rank * part, part)


class SpatialConv(nn.Module):
    """A ``Conv2d`` or ``Conv3d`` (stride 1, odd cubic kernel, ``padding = k // 2``) on input
    split along its first spatial dimension (dim 2: height, or depth for 3-D).

    Args:
        conv: the plain convolution whose weights it keeps (replicated on every rank).
        distribution: the grid; dim 2 is split across its MODEL group.
        name: for errors.

    Raises:
        TypeError: ``conv`` is neither an nn.Conv2d nor an nn.Conv3d.
        ValueError: a stride, dilation, kernel or padding it cannot split (named).
    """

    def __init__(self, conv: nn.Conv2d | nn.Conv3d, *, distribution: Distribution,
                 name: str = "") -> None:
        super().__init__()
        if not isinstance(conv, (nn.Conv2d, nn.Conv3d)):
            raise TypeError(f"SpatialConv {name or '(unnamed)'}: expected an nn.Conv2d or "
                            f"nn.Conv3d, got {type(conv).__name__}")
        k = conv.kernel_size
        ones = (1,) * len(k)
        if (conv.stride != ones or conv.dilation != ones or len(set(k)) != 1 or k[0] % 2 == 0
                or conv.padding != tuple(n // 2 for n in k) or conv.padding_mode != "zeros"):
            raise ValueError(
                f"SpatialConv {name or '(unnamed)'}: needs stride 1, dilation 1, an odd cubic "
                f"kernel and zero padding k // 2; got stride {conv.stride}, dilation "
                f"{conv.dilation}, kernel {k}, padding {conv.padding} ({conv.padding_mode})")
        self.comm = distribution.communicator(GroupType.MODEL)
        self.halo = k[0] // 2
        self.convolve = F.conv2d if len(k) == 2 else F.conv3d
        self.layer_name = name
        self.exchange_recorder = ExchangeRecorder(name)
        self.groups = conv.groups
        self.weight = conv.weight
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rec = self.exchange_recorder
        extended = halo_exchange(x, self.comm, self.halo, rec)
        weight = copy_to_model(self.weight, self.comm, rec)  # its gradient: summed over the rows
        bias = copy_to_model(self.bias, self.comm, rec) if self.bias is not None else None
        padding = (0, *(self.halo,) * (extended.dim() - 3))  # dim 2 is padded by the halos
        return self.convolve(extended, weight, bias, padding=padding, groups=self.groups)
