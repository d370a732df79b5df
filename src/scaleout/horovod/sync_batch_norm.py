"""Horovod's ``SyncBatchNorm``: batch normalisation with statistics over every rank's batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from scaleout.horovod.autograd import allreduce
from scaleout.horovod.ops import Sum
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the union of the ranks' batches (in training; local in eval).

    Each rank's per-channel count, mean and sum of squared deviations travel to the others in
    the differentiable :func:`scaleout.horovod.allreduce` and are combined exactly (no
    ``E[x^2] - E[x]^2`` cancellation for inputs far from zero), so forward and backward match
    ``torch.nn.BatchNorm*d`` on the concatenated batch. Ranks may pass different batch sizes.

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
        channels = input.shape[1]
        shape = [1, channels] + [1] * (input.dim() - 2)
        # statistics in at least float32 (as torch's batch norm keeps them): float16 and
        # bfloat16 sums of a batch lose the variance to cancellation
        wide = input.to(torch.promote_types(input.dtype, torch.float32))
        n, mean, var = _global_moments(wide, self.process_set)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                unbiased = var * n / torch.clamp(n - 1, min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        out = (wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)


def _global_moments(wide: torch.Tensor, process_set: ProcessSet
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) per channel of the members' batches together.

    Each member takes the moments of its own batch about a shift near its mean (so no
    ``E[x^2] - E[x]^2`` cancellation, which lost the whole variance of float32 inputs 3000
    away from zero), and the members' (count, mean, M2) are combined exactly (Chan, Golub and
    LeVeque's pairwise update, over all members at once), in float64: the rounding of each
    member's mean to float32 would otherwise weigh on the spread between the members' means.
    The rows travel in one differentiable Sum allreduce of a table holding this member's row
    and zeros elsewhere: in effect an allgather, but one whose backward sums the gradients,
    as the exact gradient of the members' summed losses needs (``hvd.allgather``'s backward
    averages them, Horovod's convention). The table is small (3 x channels per member).
    A member may have no rows (count 0: it adds nothing).
    """
    channels = wide.shape[1]
    dims = [d for d in range(wide.dim()) if d != 1]
    shape = [1, channels] + [1] * (wide.dim() - 2)
    rows = wide.numel() // channels
    # any shift gives the same moments: one near the mean keeps the sums small (no gradient
    # flows through it, analytically none would)
    shift = (wide.detach().sum(dims) / max(rows, 1)).view(shape)
    centred = wide - shift
    deviation = centred.sum(dims).double()  # the shift's rounding, recovered
    squares = (centred * centred).sum(dims).double()
    count = deviation.new_full((channels,), float(rows))
    per_row = deviation / max(rows, 1)
    local_mean = shift.view(channels).double() + per_row
    local_m2 = squares - deviation * per_row
    mine = torch.stack([count, local_mean, local_m2]).unsqueeze(0)  # (1, 3, channels)
    me, size = process_set.rank(), process_set.size()
    table = allreduce(F.pad(mine, (0, 0, 0, 0, me, size - me - 1)), op=Sum, name=None,
                      process_set=process_set)
    counts, means, m2s = table.unbind(1)  # each (size, channels)
    n = counts.sum(0)
    mean = (counts * means).sum(0) / n
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return n.to(wide.dtype), mean.to(wide.dtype), (m2 / n).to(wide.dtype)
