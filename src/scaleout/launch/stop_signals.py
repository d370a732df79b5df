"""The signals that stop a run (SIGTERM, SIGHUP, SIGINT), taken by ``scaleout run`` and by
``scaleout bench train`` under one rule: a stop signal this process inherited as ignored
(``nohup``'s SIGHUP; SIGINT in the background job of a script) stays ignored."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["STOP_SIGNALS", "Stopped", "take_stop_signals", "restore_signals", "raise_on_stop"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def take_stop_signals(handler: Callable[[int, Any], Any]) -> dict[int, Any]:
    """Send every stop signal not ignored here to ``handler``.

    Returns:
        The handlers it replaced, by signal (for :func:`restore_signals`).

    Raises:
        ValueError: not in the main thread (as ``signal.signal``).
    """
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS
            if signal.getsignal(sig) != signal.SIG_IGN}


def restore_signals(previous: Mapping[int, Any]) -> None:
    """Put back the handlers :func:`take_stop_signals` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (raised by :func:`raise_on_stop`); ``signum`` is the signal."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = int(signum)


@contextlib.contextmanager
def raise_on_stop(make: Callable[[int], BaseException] = Stopped) -> Iterator[None]:
    """Inside, the first stop signal raises ``make(signum)`` (a ``KeyboardInterrupt``, so
    clean-up runs as on Ctrl-C); later ones, and any while an interrupt unwinds, are ignored
    so that they cannot cut the clean-up short. Only in the main thread, where Python can
    take signals (elsewhere it changes nothing)."""
    got: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if not got and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            got.append(signum)
            raise make(signum)

    try:
        previous = take_stop_signals(stop)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        restore_signals(previous)
