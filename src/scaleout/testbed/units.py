"""Parsing and formatting of the quantities a testbed link is described with.

The spellings follow ``tc``: rates such as ``100mbit``/``1gbit``/``10gbit``
(decimal: ``1gbit`` is 10**9 bit/s), times such as ``50us``/``1ms`` and loss such as
``0.1%``. Every parser raises :class:`ValueError` naming the field, the expected form
and the value received.

Example:
    >>> parse_rate("1gbit", field="rate")
    1000000000
    >>> parse_time("50us", field="delay")
    5e-05
    >>> parse_percent("0.1%", field="loss")
    0.001
"""

from __future__ import annotations

import re

__all__ = [
    "parse_rate",
    "parse_time",
    "parse_percent",
    "format_rate",
    "format_time",
]

_NUMBER = r"(?P<value>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"

# tc's decimal rate units (bits per second); "bit" alone is bits per second.
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
}
_TIME_UNITS = {"ns": 1e9, "us": 1e6, "ms": 1e3, "s": 1.0}  # per second (division is exact-er)

_RATE_RE = re.compile(_NUMBER + r"\s*(?P<unit>[a-z]+)")
_TIME_RE = re.compile(_NUMBER + r"\s*(?P<unit>[a-z]+)")
_PERCENT_RE = re.compile(_NUMBER + r"\s*%")


def parse_rate(text: str, *, field: str = "rate") -> int:
    """Parse a ``tc`` rate such as ``"1gbit"`` into bits per second.

    Args:
        text: the rate, a positive number followed by ``bit``, ``kbit``, ``mbit``,
            ``gbit`` or ``tbit`` (case-insensitive).
        field: the name of the setting, used in error messages.

    Returns:
        The rate in bits per second (an integer, at least 1).

    Raises:
        TypeError: if ``text`` is not a string.
        ValueError: if ``text`` is not of that form or is not positive.
    """
    match = _match(_RATE_RE, text, field, "a rate such as 100mbit, 1gbit or 10gbit")
    unit = match.group("unit")
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"{field}: expected a rate unit among {', '.join(_RATE_UNITS)} "
            f"(e.g. 1gbit), got {text!r}"
        )
    bits = round(float(match.group("value")) * _RATE_UNITS[unit])
    if bits < 1:
        raise ValueError(f"{field}: expected a positive rate such as 1gbit, got {text!r}")
    return bits


def parse_time(text: str, *, field: str = "delay") -> float:
    """Parse a ``tc`` time such as ``"50us"`` or ``"1ms"`` into seconds.

    Args:
        text: a non-negative number followed by ``ns``, ``us``, ``ms`` or ``s``.
            ``"0"`` is accepted without a unit.
        field: the name of the setting, used in error messages.

    Returns:
        The time in seconds.

    Raises:
        TypeError: if ``text`` is not a string.
        ValueError: if ``text`` is not of that form.
    """
    if isinstance(text, str) and text.strip() == "0":
        return 0.0
    match = _match(_TIME_RE, text, field, "a time such as 0us, 50us or 1ms")
    unit = match.group("unit")
    if unit not in _TIME_UNITS:
        raise ValueError(
            f"{field}: expected a time unit among {', '.join(_TIME_UNITS)} "
            f"(e.g. 50us), got {text!r}"
        )
    return float(match.group("value")) / _TIME_UNITS[unit]


def parse_percent(text: str, *, field: str = "loss") -> float:
    """Parse a percentage such as ``"0.1%"`` into a fraction in [0, 1].

    Args:
        text: a number between 0 and 100 followed by ``%``.
        field: the name of the setting, used in error messages.

    Returns:
        The fraction (``"0.1%"`` -> ``0.001``).

    Raises:
        TypeError: if ``text`` is not a string.
        ValueError: if ``text`` is not of that form or exceeds 100%.
    """
    match = _match(_PERCENT_RE, text, field, "a percentage such as 0% or 0.1%")
    fraction = float(match.group("value")) / 100.0
    if fraction > 1.0:
        raise ValueError(f"{field}: expected a percentage between 0% and 100%, got {text!r}")
    return fraction


def format_rate(bits_per_second: float) -> str:
    """Format bits per second the way ``tc`` would accept it (``1gbit``, ``2.5mbit``).

    Args:
        bits_per_second: the rate.

    Returns:
        The shortest exact-looking spelling with a decimal unit.
    """
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_UNITS[unit]
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"


def format_time(seconds: float) -> str:
    """Format seconds for ``tc`` (``50us``, ``1ms``); whole microseconds below 1 s.

    Args:
        seconds: a non-negative time.

    Returns:
        The time in microseconds, e.g. ``"50us"``.
    """
    return f"{seconds * 1e6:g}us"


def _match(pattern: re.Pattern[str], text: object, field: str, expected: str) -> re.Match[str]:
    if not isinstance(text, str):
        raise TypeError(f"{field}: expected a string ({expected}), got {type(text).__name__} {text!r}")
    match = pattern.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"{field}: expected {expected}, got {text!r}")
    return match
