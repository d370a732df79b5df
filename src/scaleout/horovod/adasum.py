"""Adasum (Maleki et al., 2021): an adaptive sum of gradients, combined pairwise in a tree.

``adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``: orthogonal gradients add,
parallel ones average. Ranks are combined as Horovod's recursive doubling does for a
power-of-two group: (0,1), (2,3), ... then pairs of pairs. The face gathers every rank's
tensor with the core's allgather and each rank computes the same tree (memory: size x tensor).
"""

from __future__ import annotations

import torch

__all__ = ["adasum_pair", "adasum_tree", "check_adasum_size"]


def check_adasum_size(size: int, operation: str) -> None:
    """Raise NotImplementedError unless ``size`` is a power of two."""
    if size & (size - 1):
        raise NotImplementedError(
            f"{operation}: op=hvd.Adasum needs a power-of-two number of ranks (as Horovod's "
            f"does), got {size}; use hvd.Average, or run 1, 2, 4, 8 ... ranks")


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors (computed in at least float32 ; a zero tensor leaves the other)."""
    dot = torch.sum(a * b)
    aa, bb = torch.sum(a * a), torch.sum(b * b)
    ca = torch.where(aa > 0, 1 - dot / (2 * aa), torch.ones_like(aa))
    cb = torch.where(bb > 0, 1 - dot / (2 * bb), torch.ones_like(bb))
    return ca * a + cb * b


def adasum_tree(stacked: torch.Tensor) -> torch.Tensor:
    """Adasum of ``stacked[0], stacked[1], ...`` (a power-of-two count) in the tree order.

    Args:
        stacked: shape ``(size, *shape)``, one row per rank.

    Returns:
        A tensor of shape ``shape`` and ``stacked``'s dtype.
    """
    work = stacked.to(torch.promote_types(stacked.dtype, torch.float32))
    level = [work[i] for i in range(work.shape[0])]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].to(stacked.dtype)
