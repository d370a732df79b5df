"""Fixed-window pools (``MaxPool``/``AvgPool`` 2-D and 3-D) on a dim-2-split activation.

A pool whose windows along dim 2 do not overlap (stride = kernel, no padding, no dilation)
and tile every rank's block of rows computes on each block what it computes on the whole,
with no exchange: :class:`SpatialPool` runs the plain pool and checks, at every forward,
that the block tiles (its height a multiple of the window), so a size that would shift the
windows across blocks is a ``ValueError`` naming the layer, never a different output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FIXED_POOLS", "SpatialPool", "check_pool"]

FIXED_POOLS = (nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool2d, nn.AvgPool3d)


def _first(value: Any) -> Any:
    """A pool option along dim 2 (the first spatial one): an int, or a tuple's first."""
    return value[0] if isinstance(value, tuple) else value


def check_pool(pool: nn.Module, name: str) -> int:
    """The window of ``pool`` along dim 2; ``ValueError`` unless its windows there tile
    (stride = kernel, padding 0, dilation 1, no ``ceil_mode``)."""
    kernel = _first(pool.kernel_size)
    stride = _first(pool.stride) or kernel
    padding, dilation = _first(pool.padding), _first(getattr(pool, "dilation", 1))
    if (stride, padding, dilation) != (kernel, 0, 1) or pool.ceil_mode:
        raise ValueError(f"spatial_parallel: layer {name} ({type(pool).__name__}) pools the "
                         f"split rows with kernel {kernel}, stride {stride}, padding {padding}, "
                         f"dilation {dilation}, ceil_mode {pool.ceil_mode}; only windows that "
                         "tile the rows (stride = kernel, no padding, dilation 1, no "
                         "ceil_mode) can be split")
    return kernel


class SpatialPool(nn.Module):
    """``pool`` (windows that tile dim 2: :func:`check_pool`) on each rank's block of rows.

    Args:
        pool: the plain pool, run as it is.
        name: the layer's name (for errors).
    """

    def __init__(self, pool: nn.Module, *, name: str = "") -> None:
        super().__init__()
        self.pool, self.name = pool, name or type(pool).__name__
        self.window = check_pool(pool, self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[2]
        if rows % self.window:
            raise ValueError(f"spatial_parallel: layer {self.name} pools windows of "
                             f"{self.window} rows, and this rank's block has {rows} rows (not a "
                             "multiple): the windows would straddle the blocks; split the "
                             "input so that every block's height divides")
        return self.pool(x)
