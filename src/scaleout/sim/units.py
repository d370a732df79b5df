"""Parsing and printing of the simulator's quantities: bytes, bandwidths, times.

Conventions (stated once, used everywhere):

* sizes: ``B``, ``KB``/``KiB``, ``MB``/``MiB``, ``GB``/``GiB`` are binary (1 MB = 2**20 B),
  as in the rest of scaleout;
* bandwidths in bits per second are decimal (``100Gbps`` = 100e9 / 8 B/s, the way links
  are sold); in bytes per second ``GB/s`` follows ASTRA-sim's analytical backend
  (1 GB = 2**30 B);
* times: ``ns``, ``us``, ``ms``, ``s``.

Example:
    >>> parse_bytes("64MB"), parse_bandwidth("100Gbps"), parse_time("2ms")
    (67108864, 12500000000.0, 0.002)
    >>> format_bytes(67108864), format_time(0.0123)
    ('64.0MB', '12.300ms')
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "parse_bandwidth", "parse_time", "format_bytes", "format_time"]

_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_RATE_UNITS = {
    "bps": 1 / 8,
    "kbps": 1e3 / 8,
    "kbit": 1e3 / 8,
    "mbps": 1e6 / 8,
    "mbit": 1e6 / 8,
    "gbps": 1e9 / 8,
    "gbit": 1e9 / 8,
    "tbps": 1e12 / 8,
    "b/s": 1.0,
    "kb/s": float(1 << 10),
    "mb/s": float(1 << 20),
    "gb/s": float(1 << 30),
}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def _parse(text: object, units: dict, what: str, example: str) -> float:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TypeError(f"{what} must be a string like {example!r} or a number, got {text!r}")
    if isinstance(text, (int, float)):
        value, scale = float(text), 1.0
    else:
        match = re.fullmatch(_NUMBER + r"([A-Za-z/]*)\s*", text)
        if match is None or match.group(2).lower() not in units:
            raise ValueError(
                f"{what} must look like {example!r} (units: "
                f"{', '.join(u for u in units if u)}), got {text!r}"
            )
        value, scale = float(match.group(1)), units[match.group(2).lower()]
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {text!r}")
    if not math.isfinite(value * scale):  # (1e400, or 1e300TB: no size a run can use)
        raise ValueError(f"{what} must be finite, got {text!r}")
    return value * scale


def parse_bytes(text: str | int | float) -> int:
    """Bytes from ``"64MB"``, ``"1.5G"``, ``"4096"`` (binary prefixes).

    Raises:
        ValueError: an unknown unit or a negative size.
        TypeError: not a string or number.
    """
    return int(round(_parse(text, _SIZE_UNITS, "size", "64MB")))


def parse_bandwidth(text: str | int | float) -> float:
    """Bytes per second from ``"100Gbps"``, ``"25gbit"``, ``"400GB/s"`` (a number: B/s).

    Raises:
        ValueError: an unknown unit or a rate that is not > 0.
    """
    value = _parse(text, _RATE_UNITS, "bandwidth", "100Gbps")
    if value <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    return value


def parse_time(text: str | int | float) -> float:
    """Seconds from ``"5us"``, ``"936.25ns"``, ``"1ms"`` (a number: seconds)."""
    return _parse(text, _TIME_UNITS, "time", "5us")


def format_bytes(nbytes: float) -> str:
    """``67108864`` -> ``"64.0MB"``."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes:.0f}B"


def format_time(seconds: float) -> str:
    """``0.0123`` -> ``"12.300ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3f}{unit}"
    return f"{seconds / 1e-9:.1f}ns"
