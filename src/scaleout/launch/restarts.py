"""What a rank learns about restarts from ``scaleout run --max-restarts K``.

The launcher starts every rank again after a failure (all of them, with a fresh
rendezvous), up to K times, and tells each rank which attempt it is: ``SCALEOUT_RESTART_COUNT``
(0 on the first start), also as torchrun's ``TORCHELASTIC_RESTART_COUNT`` so torch-style
scripts work unchanged. ``SCALEOUT_STATE_DIR`` names a directory that outlives the attempts
of one ``scaleout run`` (removed when it ends, unless the user set the variable): where
``hvd.elastic`` keeps its commits.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RESTART_VAR", "MAX_RESTARTS_VAR", "STATE_DIR_VAR", "TORCH_RESTART_VAR",
           "TORCH_MAX_RESTARTS_VAR", "restart_count", "state_dir", "attempt_env"]

RESTART_VAR = "SCALEOUT_RESTART_COUNT"
MAX_RESTARTS_VAR = "SCALEOUT_MAX_RESTARTS"
STATE_DIR_VAR = "SCALEOUT_STATE_DIR"
TORCH_RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"
TORCH_MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"


def attempt_env(attempt: int, max_restarts: int, state: str) -> dict[str, str]:
    """The variables the launcher sets on every rank of attempt ``attempt`` (0-based)."""
    return {RESTART_VAR: str(attempt), TORCH_RESTART_VAR: str(attempt),
            MAX_RESTARTS_VAR: str(max_restarts), TORCH_MAX_RESTARTS_VAR: str(max_restarts),
            STATE_DIR_VAR: state}


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was restarted before this attempt (0: the first start).

    Reads ``SCALEOUT_RESTART_COUNT``, else torchrun's ``TORCHELASTIC_RESTART_COUNT``.

    Raises:
        ValueError: the variable is set but is not a non-negative integer.
    """
    for name in (RESTART_VAR, TORCH_RESTART_VAR):
        value = environ.get(name)
        if value is not None:
            if not value.isdigit():
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            return int(value)
    return 0


def state_dir(environ: Mapping[str, str]) -> str | None:
    """The directory that outlives restarts (``SCALEOUT_STATE_DIR``), or None when unset."""
    return environ.get(STATE_DIR_VAR) or None
