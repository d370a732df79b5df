"""scaleout: scale-out PyTorch training on torch.distributed.

The names below are imported on first use, so that ``import scaleout`` (and the
``scaleout --help`` command line) does not pay for importing torch.

Example:
    >>> import scaleout
    >>> from scaleout import GroupType
    >>> env = scaleout.init()
    >>> d = env.create_distribution(env.world_size, 1)
    >>> d.allreduce(torch.ones(4), group=GroupType.DATA).wait()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "init": "scaleout.core.env",
    "Environment": "scaleout.core.env",
    "Distribution": "scaleout.core.distribution",
    "GroupType": "scaleout.core.grid",
    "ReduceOp": "scaleout.core.collectives",
    "Request": "scaleout.core.request",
    "Session": "scaleout.session",
    "Phase": "scaleout.session",
    "ParameterSetSpec": "scaleout.session",
    "ActivationSpec": "scaleout.session",
    "Exchange": "scaleout.session",
    "SchedulerConfig": "scaleout.scheduler",
    "ScaleoutError": "scaleout.core.errors",
    "CommunicationError": "scaleout.core.errors",
    "CommunicationTimeout": "scaleout.core.errors",
    "NotInitializedError": "scaleout.core.errors",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from scaleout.core.collectives import ReduceOp
    from scaleout.core.distribution import Distribution
    from scaleout.core.env import Environment, init
    from scaleout.core.errors import (
        CommunicationError,
        CommunicationTimeout,
        NotInitializedError,
        ScaleoutError,
    )
    from scaleout.core.grid import GroupType
    from scaleout.core.request import Request
    from scaleout.scheduler import SchedulerConfig
    from scaleout.session import ActivationSpec, Exchange, ParameterSetSpec, Phase, Session


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scaleout' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
