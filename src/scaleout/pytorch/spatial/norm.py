"""What follows a spatially split convolution: a global average pool and batch normalisation
whose statistics span the whole (split) sample.

``SpatialGlobalAvgPool`` sums each rank's block and allreduces (its output feeds replicated
layers, so the backward is the identity). ``SpatialBatchNorm``'s per-channel sums feed every
rank's own rows, so they are allreduced forward *and* backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.exchange_stats import ExchangeRecorder
from scaleout.pytorch.tensor_parallel.exchanges import copy_to_model, reduce_from_model

__all__ = ["SpatialGlobalAvgPool", "SpatialBatchNorm"]


class SpatialGlobalAvgPool(nn.Module):
    """Mean over every spatial dimension of a dim-2-split activation -> ``(N, C)``,
    replicated on every rank of the model group."""

    def __init__(self, *, distribution: Distribution) -> None:
        super().__init__()
        self.comm = distribution.communicator(GroupType.MODEL)
        self.exchange_recorder = ExchangeRecorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums = x.sum(dim=tuple(range(2, x.dim())))
        # the positions of every rank's block travel with the sums (blocks may differ)
        total = reduce_from_model(_with_count(sums, math.prod(x.shape[2:])), self.comm,
                                  self.exchange_recorder)
        return total[:-1].view_as(sums) / total[-1]


def _with_count(sums: torch.Tensor, count: int) -> torch.Tensor:
    """``sums`` flat, then ``count``: one allreduce adds both over the model group."""
    return torch.cat([sums.reshape(-1), sums.new_full((1,), float(count))])


class SpatialBatchNorm(nn.Module):
    """A ``BatchNorm2d``/``3d`` whose statistics span the whole split sample (each channel's
    sum and sum of squares are allreduced over the model group, forward and backward).

    Args:
        norm: the plain layer whose affine weights and running statistics it keeps.
        distribution: the grid; dim 2 is split across its MODEL group.
        name: for errors.

    Raises:
        TypeError: ``norm`` is not an nn.BatchNorm2d/3d.
        ValueError: ``norm`` does not track running statistics (not supported).
    """

    def __init__(self, norm: nn.BatchNorm2d | nn.BatchNorm3d, *, distribution: Distribution,
                 name: str = "") -> None:
        super().__init__()
        if not isinstance(norm, (nn.BatchNorm2d, nn.BatchNorm3d)):
            raise TypeError(f"SpatialBatchNorm {name or '(unnamed)'}: expected an "
                            f"nn.BatchNorm2d or nn.BatchNorm3d, got {type(norm).__name__}")
        if not norm.track_running_stats or norm.momentum is None:
            raise ValueError(f"SpatialBatchNorm {name or '(unnamed)'}: needs "
                             "track_running_stats=True and a numeric momentum")
        self.comm = distribution.communicator(GroupType.MODEL)
        self.exchange_recorder = ExchangeRecorder(name)
        self.eps, self.momentum, self.affine = norm.eps, norm.momentum, norm.affine
        # its own tensors (same names as BatchNorm's): DataParallel updates a layer's weights
        # in that layer's forward pre-hook
        self.weight, self.bias = norm.weight, norm.bias
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(buffer, getattr(norm, buffer))

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        # the total feeds every rank's own rows: its gradient must be summed too
        rec = self.exchange_recorder
        return copy_to_model(reduce_from_model(x, self.comm, rec), self.comm, rec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # (the affine weights' gradients still span every rank's rows)
            return F.batch_norm(x, self.running_mean, self.running_var, *self._affine(),
                                False, 0.0, self.eps)
        dims = (0, *range(2, x.dim()))
        shape = (1, -1, *(1,) * (x.dim() - 2))
        # every rank's count of positions travels with the sums (blocks may differ in height)
        totals = self._sum(_with_count(x.sum(dim=dims), x.numel() // x.shape[1]))
        count = totals[-1].detach()  # (a tensor: no host synchronisation on a GPU)
        mean = totals[:-1] / count
        centred = x - mean.view(shape)
        var = self._sum((centred * centred).sum(dim=dims)) / count
        with torch.no_grad():
            # (an empty batch's statistics are 0 / 0: BatchNorm keeps the old ones)
            seen = count > 0
            new_mean = self.running_mean * (1 - self.momentum) + mean.detach() * self.momentum
            unbiased = var.detach() * count / (count - 1).clamp(min=1)
            new_var = self.running_var * (1 - self.momentum) + unbiased * self.momentum
            self.running_mean.copy_(torch.where(seen, new_mean, self.running_mean))
            self.running_var.copy_(torch.where(seen, new_var, self.running_var))
            self.num_batches_tracked.add_(1)
        out = centred / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            weight, bias = self._affine()
            out = out * weight.view(shape) + bias.view(shape)
        return out

    def _affine(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The affine weight and bias (``None`` without), entered into the model group: each
        rank's gradient is its rows' share, summed over the group backward (in training and
        in evaluation mode alike: frozen statistics, trained weights)."""
        if not self.affine:
            return None, None
        rec = self.exchange_recorder
        return (copy_to_model(self.weight, self.comm, rec),
                copy_to_model(self.bias, self.comm, rec))
