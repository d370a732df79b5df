"""A tensor compared with a number: sign's negative values as a bool mask, top-k's candidates
as indices.

On the CPU numpy does the comparisons: its kernels are ~3.5x torch's on one thread (2.4M
float32 values: ``x < 0`` into a bool buffer 0.42 ms against 1.45; the indices of the values
not below a threshold 0.98 ms against 3.4; benchmarks/RESULTS.md, stop 41). Elsewhere (CUDA)
torch does them. Both give the same results, NaN included (it is not below anything).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["negative_into", "not_below"]

_NUMPY_DTYPES = (torch.float32, torch.float64)  # (numpy has no bfloat16)


def _by_numpy(values: torch.Tensor) -> bool:
    return (values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES
            and values.is_contiguous() and not values.requires_grad)


def negative_into(values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = values < 0`` (``-0.0`` and NaN: False).

    Args:
        values: A float tensor.
        out: A bool tensor of ``values``' shape, on its device (written).

    Returns:
        ``out``.
    """
    if _by_numpy(values) and out.is_contiguous():
        np.less(values.numpy(), 0, out=out.numpy())
        return out
    return torch.lt(values, 0, out=out)


def not_below(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The indices (int64, ascending) of the flat ``values`` that are not below ``threshold``
    (a 0-d tensor): ``>=`` it, or NaN.

    On a device this waits for the host: the number of indices sizes the result.
    """
    if _by_numpy(values):
        below = np.less(values.numpy().reshape(-1), threshold.item())
        return torch.from_numpy(np.flatnonzero(np.logical_not(below, out=below)))
    return torch.lt(values.reshape(-1), threshold).logical_not_().nonzero().view(-1)
