"""Small helpers for benchmark statistics and sizes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from scaleout.sim.units import parse_bytes

__all__ = ["parse_sizes", "format_size", "median", "spread"]


def parse_sizes(text: str, factor: int = 4) -> list[int]:
    """``"1K..64M"`` (powers of ``factor`` in between) or a comma list ``"1M,16M"`` (each
    size as :func:`~scaleout.sim.units.parse_bytes` reads it)."""
    if ".." in text:
        low, high = (parse_bytes(part) for part in text.split("..", 1))
        if low < 1 or high < low:
            raise ValueError(f"size range must be increasing and positive, got {text!r}")
        sizes, size = [], low
        while size <= high:
            sizes.append(size)
            size *= factor
        return sizes
    sizes = [parse_bytes(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {text!r}")
    return sizes


def format_size(size: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size:g}B"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> tuple[float, float]:
    return float(min(values)), float(max(values))
