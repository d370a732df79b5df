"""scaleout: scale-out PyTorch training on torch.distributed.

Example:
    >>> import scaleout
    >>> from scaleout import GroupType
    >>> env = scaleout.init()
    >>> d = env.create_distribution(env.world_size, 1)
    >>> d.allreduce(torch.ones(4), group=GroupType.DATA).wait()
"""

from scaleout.core.collectives import ReduceOp
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.core.env import Environment, init
from scaleout.core.errors import (
    CommunicationError,
    CommunicationTimeout,
    NotInitializedError,
    ScaleoutError,
)
from scaleout.core.request import Request
from scaleout.scheduler import SchedulerConfig
from scaleout.session import (
    ActivationSpec,
    Exchange,
    ParameterSetSpec,
    Phase,
    Session,
)

__version__ = "0.1.0"

__all__ = [
    "init", "Environment", "Distribution", "GroupType", "ReduceOp", "Request",
    "Session", "Phase", "ParameterSetSpec", "ActivationSpec", "Exchange", "SchedulerConfig",
    "ScaleoutError", "CommunicationError", "CommunicationTimeout", "NotInitializedError",
    "__version__",
]
