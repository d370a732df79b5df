"""A plain-text progress bar on stderr for ``scaleout bench train`` (no dependency).

On a terminal the bar redraws in place; elsewhere (a log file, CI) it prints one line per
finished run so logs stay short.

Example:
    >>> import io
    >>> bar = ProgressBar(total=2, stream=io.StringIO(), width=10)
    >>> bar.start("round 1/1 single")
    >>> bar.update(0.5)
    >>> bar.render()[:16]
    '[##--------]  25'
"""

from __future__ import annotations

import sys
import time
from typing import IO

__all__ = ["ProgressBar"]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ProgressBar:
    """Progress over ``total`` runs, each reporting its own fraction done.

    Args:
        total: number of runs.
        stream: where to draw (default ``sys.stderr``).
        width: characters of the bar itself.
        enabled: draw at all (``False`` for ``--quiet``-like uses and tests).
    """

    def __init__(self, total: int, *, stream: IO[str] | None = None, width: int = 30,
                 enabled: bool = True) -> None:
        if total < 1:
            raise ValueError(f"total: expected at least 1 run, got {total}")
        self._total = total
        self._stream = sys.stderr if stream is None else stream
        self._width = width
        self._enabled = enabled
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._done = 0
        self._fraction = 0.0
        self._label = ""
        self._started = time.monotonic()
        self._drawn = 0.0

    def start(self, label: str) -> None:
        """A run begins; ``label`` says which (e.g. ``"round 2/3 ddp"``)."""
        self._label, self._fraction = label, 0.0
        self._draw(force=True)

    def update(self, fraction: float) -> None:
        """The current run is ``fraction`` (0..1) done."""
        self._fraction = min(max(fraction, 0.0), 1.0)
        self._draw()

    def finish_run(self, note: str = "") -> None:
        """The current run ended; ``note`` (e.g. its throughput) is shown with it."""
        self._done += 1
        self._fraction = 0.0
        if self._enabled and not self._tty:
            self._stream.write(f"{self.render()}  {self._label} {note}".rstrip() + "\n")
            self._stream.flush()
        else:
            self._label = f"{self._label} {note}".rstrip()
            self._draw(force=True)

    def close(self) -> None:
        """End the bar's line (call once, at the end or on an error)."""
        if self._enabled and self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def render(self) -> str:
        """The bar, percentage, runs done, elapsed and estimated remaining time."""
        progress = (self._done + self._fraction) / self._total
        filled = int(progress * self._width)
        elapsed = time.monotonic() - self._started
        left = f", ~{_clock(elapsed / progress - elapsed)} left" if progress > 0.02 else ""
        return (f"[{'#' * filled}{'-' * (self._width - filled)}] {progress * 100:3.0f}%  "
                f"{self._done}/{self._total} runs, "
                f"{_clock(elapsed)} elapsed{left}")

    def _draw(self, force: bool = False) -> None:
        if not (self._enabled and self._tty):
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.2:
            return
        self._drawn = now
        self._stream.write(f"\r\x1b[K{self.render()}  {self._label}")
        self._stream.flush()
