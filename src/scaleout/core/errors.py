"""Exceptions raised by scaleout."""

from __future__ import annotations

__all__ = ["ScaleoutError", "CommunicationError", "CommunicationTimeout", "NotInitializedError",
           "PeerFailedError"]


class ScaleoutError(RuntimeError):
    """Base class of scaleout's runtime errors."""


class NotInitializedError(ScaleoutError):
    """An Environment was used before :func:`scaleout.init` or after ``finalize()``."""


class CommunicationError(ScaleoutError):
    """A collective failed. The message names the rank, the group and the operation."""

    def __init__(self, message: str, *, rank: int, group: str, operation: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.group = group
        self.operation = operation


class CommunicationTimeout(CommunicationError):
    """A wait on a collective exceeded its timeout.

    Attributes:
        why: what is known of the cause (a peer alive but elsewhere, this process stopped),
            for a front end that words the error its own way.
    """

    why: str = ""


class PeerFailedError(CommunicationError):
    """A peer rank died, froze or left while this rank waited on it.

    Attributes:
        failed_rank: the global rank that failed (``rank`` is the rank that raised).
    """

    def __init__(self, message: str, *, rank: int, group: str, operation: str,
                 failed_rank: int) -> None:
        super().__init__(message, rank=rank, group=group, operation=operation)
        self.failed_rank = failed_rank
