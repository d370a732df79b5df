"""The exceptions of the Horovod face, named as ``horovod.torch`` names them."""

from __future__ import annotations

from scaleout.core.errors import NotInitializedError, ScaleoutError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "NotInitialized", "TensorMismatchError"]


class HorovodInternalError(ScaleoutError):
    """A collective failed inside the engine (Horovod's name for it)."""


class HostsUpdatedInterrupt(ScaleoutError):
    """Horovod's elastic-mode signal that the set of hosts changed (never raised: hosts do not
    change while a scaleout job runs; a failed job restarts at the same size)."""


class NotInitialized(NotInitializedError, ValueError):
    """A Horovod function was called before ``hvd.init()`` (or after ``hvd.shutdown()``).

    A ValueError as in Horovod, and a scaleout NotInitializedError.
    """


class TensorMismatchError(ScaleoutError, ValueError):
    """Ranks called the same collective with different names, ops, dtypes or shapes.

    Raised on every rank of the process set, before any data moves (so nobody hangs).
    A RuntimeError (as Horovod raises) and a ValueError (as scaleout's checks raise).
    """
