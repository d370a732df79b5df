"""Argument checks shared by the collectives: errors that say what was expected and received."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import torch

__all__ = ["SUPPORTED_DTYPES", "MAX_SECONDS", "check_tensor", "check_root", "check_counts",
           "check_divisible", "check_seconds", "check_cuda_asked", "overlaps"]

#: The longest timeout or period accepted (a year): longer ones overflow torch's timers.
MAX_SECONDS = 365 * 86400.0

SUPPORTED_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
    torch.uint8, torch.int8,
)


def check_tensor(tensor: object, operation: str) -> torch.Tensor:
    """Return ``tensor`` if it is a tensor of a supported dtype, else raise TypeError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{operation}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{operation}: dtype {tensor.dtype} is not supported (supported: {names})")
    if tensor.is_sparse:
        raise TypeError(f"{operation}: expected a dense (strided) tensor, got a sparse one")
    return tensor


def check_root(root: object, size: int, operation: str, group: str) -> int:
    """Return ``root`` if it is a rank of a group of ``size`` ranks, else raise."""
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"{operation}: root must be an int rank, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(
            f"{operation}: root must be a rank of group {group} (0..{size - 1}), got {root}"
        )
    return root


def check_counts(counts: object, size: int, name: str, operation: str) -> list[int]:
    """Return ``counts`` as a list of ``size`` non-negative ints, else raise."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    if not isinstance(counts, Sequence) or isinstance(counts, (str, bytes)):
        raise TypeError(f"{operation}: {name} must be a sequence of ints, got {type(counts).__name__}")
    values = list(counts)
    if len(values) != size:
        raise ValueError(
            f"{operation}: {name} must have one entry per rank of the group ({size}), "
            f"got {len(values)}"
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{operation}: {name} must hold ints, got {value!r}")
        if value < 0:
            raise ValueError(f"{operation}: {name} must be >= 0, got {values}")
    return values


def check_divisible(tensor: torch.Tensor, size: int, operation: str) -> int:
    """Return dim-0 length / ``size``; raise ValueError unless it divides."""
    if tensor.dim() == 0 or tensor.shape[0] % size != 0:
        shape = tuple(tensor.shape)
        raise ValueError(
            f"{operation}: dim 0 must be a multiple of the group size {size} "
            f"(one equal block per rank), got shape {shape}"
        )
    return tensor.shape[0] // size


def check_seconds(value: object, name: str) -> float:
    """``value`` (seconds or a timedelta) as a finite float in (0, MAX_SECONDS], else raise.

    Raises:
        TypeError: not an int, a float or a timedelta.
        ValueError: not finite, not positive, or longer than a year.
    """
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{name} must be > 0 seconds, finite and at most {MAX_SECONDS:g} (a "
                         f"year), got {value!r}")
    return float(value)


def check_cuda_asked(device: str) -> None:
    """Raise ValueError when ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``) asks for a GPU
    that torch cannot see here (before any rank is started for it)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device here")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ``a`` and ``b`` span (from their first to their last element)
    overlaps."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
