"""Parsing and printing of the simulator's quantities: bytes, bandwidths, times.

Conventions (stated once, used everywhere):

* sizes: ``B``, ``KB``/``KiB``, ``MB``/``MiB``, ``GB``/``GiB`` are binary (1 MB = 1 MiB =
  2**20 B), as in the rest of scaleout; the prefix's case is free (``64mB``), a bare prefix is
  bytes (``64M``), but a lower-case ``b`` (``64Mb``, ``64kb``, ``8b``) is bits, as in a rate,
  and is refused rather than read as bytes (since stop 52; it read ``64Mb`` as 64 MiB, 8x the
  64 megabits it says);
* bandwidths in bits per second are decimal (``100Gbps`` = 100e9 / 8 B/s, the way links
  are sold); in bytes per second ``GB/s`` follows ASTRA-sim's analytical backend
  (1 GB = 2**30 B). The prefix's case is free; the ``b`` is not: ``b`` (``Gbps``, ``Gb/s``,
  ``gbit``) is bits, ``B`` (``GB/s``, ``GBps``) bytes, as in SI and on network cards;
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
    "b": 1,  # (the unit is matched without case; bits are refused before, by its own case)
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
#: Rate prefixes (any case): decimal for bits, binary for bytes (ASTRA-sim's GB/s).
_RATE_PREFIXES = {"": (1.0, 1.0), "k": (1e3, 2.0**10), "m": (1e6, 2.0**20), "g": (1e9, 2.0**30),
                  "t": (1e12, 2.0**40)}
_RATE_FORMS = "bps, b/s or bit (bits), B/s, Bps or iB/s (bytes), after k, M, G or T"
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
    """Bytes from ``"64MB"``, ``"1.5G"``, ``"4096"`` (binary prefixes: ``MB`` = ``MiB``).

    Raises:
        ValueError: an unknown unit, a unit in bits (a lower-case ``b``: ``64Mb``), a
            negative size or one below a byte.
        TypeError: not a string or number.
    """
    if isinstance(text, str):
        match = re.fullmatch(_NUMBER + r"([A-Za-z/]*)\s*", text)
        if match and match.group(2).endswith("b") and match.group(2).lower() in _SIZE_UNITS:
            unit, prefix = match.group(2), match.group(2)[:-1].rstrip("i").upper()
            raise ValueError(
                f"size {text!r}: a lower-case b ({unit}) means bits, as in a rate (100Gbps), and "
                f"sizes are bytes: write {match.group(1)}{prefix}B for bytes (1 {prefix}B = "
                f"{_SIZE_UNITS[unit.lower()]} B), or bits / 8 in bytes for bits")
    value = _parse(text, _SIZE_UNITS, "size", "64MB")
    if 0 < value < 0.5:  # (it rounded to 0 B, and the collective was skipped, silently)
        raise ValueError(f"size must be at least one byte, got {text!r}")
    return int(round(value))


def _rate_scale(unit: str) -> float | None:
    """Bytes per second in one ``unit`` (``Gbps``, ``GB/s``...), or None for no rate unit.

    Only the ``b`` tells bits from bytes: folding its case read ``100Gb/s`` (bits, as links
    are sold) as 100 GiB/s, 8.6x too fast, and ``100GBps`` (bytes) 8x too slow."""
    prefix = unit[:1].lower() if unit[:1].lower() in "kmgt" and len(unit) > 1 else ""
    rest = unit[len(prefix):]
    if prefix and rest[:2] == "iB":  # GiB/s: what GB/s already is here
        rest = rest[1:]
    bits, octets = _RATE_PREFIXES[prefix]
    if rest.lower() in ("bit", "bits", "bit/s", "bits/s") or (
            rest[:1] == "b" and rest[1:].lower() in ("ps", "/s")):
        return bits / 8
    if rest[:1] == "B" and rest[1:].lower() in ("ps", "/s"):
        return octets
    return None


def parse_bandwidth(text: str | int | float) -> float:
    """Bytes per second from ``"100Gbps"``, ``"25gbit"``, ``"100Gb/s"`` (bits), ``"400GB/s"``
    (bytes, 1 GB = 2**30 B); a number is B/s.

    Raises:
        ValueError: an unknown unit or a rate that is not > 0.
    """
    if isinstance(text, str):
        match = re.fullmatch(_NUMBER + r"([A-Za-z/]*)\s*", text)
        scale = _rate_scale(match.group(2)) if match else None
        if scale is None:
            raise ValueError(f"bandwidth must look like '100Gbps' or '400GB/s' ({_RATE_FORMS}), "
                             f"got {text!r}")
        value = float(match.group(1)) * scale
        if not math.isfinite(value):  # (1e400Gbps)
            raise ValueError(f"bandwidth must be finite, got {text!r}")
    else:
        value = _parse(text, {}, "bandwidth", "100Gbps")
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
