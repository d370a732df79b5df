"""Horovod's ``SyncBatchNorm``: batch normalisation with statistics over every rank's batch."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from scaleout.horovod.autograd import allreduce
from scaleout.horovod.ops import Sum
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the union of the ranks' batches (in training; local in eval).

    The per-channel sums, sums of squares and counts are reduced with the differentiable
    :func:`scaleout.horovod.allreduce`, so backward is exact as well.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm*d``.
        process_set: the ranks whose batches are normalised together.

    Raises:
        ValueError: (in forward) an input with fewer than 2 dimensions.

    Example:
        >>> bn = hvd.SyncBatchNorm(16)
        >>> y = bn(torch.randn(8, 16, 4, 4))     # statistics over 8 x size images
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of 2 or more dimensions "
                             f"(N, C, ...), got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        dims = [d for d in range(input.dim()) if d != 1]
        # statistics in at least float32 (as torch's batch norm keeps them): float16 and
        # bfloat16 sums of a batch lose the variance to cancellation
        wide = input.to(torch.promote_types(input.dtype, torch.float32))
        count = torch.tensor([input.numel() // input.shape[1]], dtype=wide.dtype,
                             device=input.device)
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims), count])
        total = allreduce(local, op=Sum, name=None, process_set=self.process_set)
        channels = input.shape[1]
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                unbiased = var * n / torch.clamp(n - 1, min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


