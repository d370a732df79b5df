"""The signals that stop a run (SIGTERM, SIGHUP, SIGINT), taken by ``scaleout run`` and by
``scaleout bench train`` under one rule: a stop signal this process inherited as ignored
(``nohup``'s SIGHUP; SIGINT in the background job of a script) stays ignored."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["STOP_SIGNALS", "take_stop_signals", "restore_signals"]

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
