"""``hvd.elastic``: Horovod's elastic training, not available until scaleout can restart ranks.

Elastic mode needs what scaleout does not have yet: a launcher that re-forms the job when
hosts come and go, a rendezvous that admits new ranks into a running job, and a state
commit/restore protocol across them. Until then every entry point raises
NotImplementedError naming what is missing, instead of training non-elastically by surprise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "MISSING"]

MISSING = ("elastic training (hvd.elastic) is not supported by scaleout yet: it needs a launcher "
           "that re-forms the job when hosts join or leave, a rendezvous that admits ranks into "
           "a running job, and state commit/restore across ranks; train without hvd.elastic "
           "(restart from a checkpoint after a failure)")


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run`` decorator; calling the decorated function raises.

    Raises:
        NotImplementedError: when the decorated function is called.
    """
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(MISSING)

    refuse.__wrapped__ = func  # type: ignore[attr-defined]
    return refuse


class State:
    """Horovod's elastic state base class; constructing one raises.

    Raises:
        NotImplementedError: always (see the module docstring).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(MISSING)


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState``; constructing one raises NotImplementedError."""


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState``; constructing one raises NotImplementedError."""


class ElasticSampler:
    """Horovod's ``hvd.elastic.ElasticSampler``; constructing one raises NotImplementedError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(MISSING)
