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
        dims = tuple(range(2, x.dim()))
        total = math.prod(x.shape[2:]) * self.comm.size  # (x[0, 0]: none in an empty batch)
        return reduce_from_model(x.sum(dim=dims), self.comm, self.exchange_recorder) / total


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

    def _sum(self, x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        # the total feeds every rank's own rows: its gradient must be summed too
        rec = self.exchange_recorder
        return copy_to_model(reduce_from_model(x.sum(dim=dims), self.comm, rec), self.comm, rec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        dims = (0, *range(2, x.dim()))
        shape = (1, -1, *(1,) * (x.dim() - 2))
        count = x.numel() // x.shape[1] * self.comm.size
        mean = self._sum(x, dims) / count
        centred = x - mean.view(shape)
        var = self._sum(centred * centred, dims) / count
        with torch.no_grad():
            if count:  # (an empty batch's statistics are 0 / 0: BatchNorm keeps the old ones)
                self.running_mean.mul_(1 - self.momentum).add_(mean.detach(),
                                                               alpha=self.momentum)
                unbiased = var.detach() * count / max(count - 1, 1)
                self.running_var.mul_(1 - self.momentum).add_(unbiased, alpha=self.momentum)
            self.num_batches_tracked.add_(1)
        out = centred / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            rec = self.exchange_recorder
            weight = copy_to_model(self.weight, self.comm, rec)  # partial gradients: summed
            bias = copy_to_model(self.bias, self.comm, rec)
            out = out * weight.view(shape) + bias.view(shape)
        return out
