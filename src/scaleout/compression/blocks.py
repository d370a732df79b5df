"""A flat tensor as rows of blocks, for the codecs that scale or quantise per block (sign,
blockquant): its whole blocks as one ``[blocks, size]`` view, its short last block as a
``[1, rest]`` view of its own, so that every per-block operation runs in place on the tensor
and no pass pads it to whole blocks."""

from __future__ import annotations

import torch

__all__ = ["block_rows"]


def block_rows(flat: torch.Tensor, size: int) -> list[tuple[torch.Tensor, slice]]:
    """``flat`` (1-D, contiguous) as ``(rows, blocks)`` views: its whole blocks of ``size``
    values, then its short last block; ``blocks`` is the slice of block indices each covers
    (index a per-block tensor with it, and a padded ``[blocks, size]`` one with
    ``[blocks, :rows.shape[1]]``). Parts with no values are left out.

    Raises:
        ValueError: ``size`` below 1.
    """
    if size < 1:
        raise ValueError(f"block size must be >= 1, got {size}")
    full, n = flat.numel() // size, flat.numel()
    cut = full * size
    parts = [(flat[:cut].view(full, size), slice(0, full))] if full else []
    if n > cut:
        parts.append((flat[cut:].view(1, -1), slice(full, full + 1)))
    return parts
