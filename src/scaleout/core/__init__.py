"""The core: who this process is (Environment), the data x model grid (Grid, Distribution),
non-blocking collectives that return a Request, and the errors they raise."""

from scaleout.core.collectives import Communicator, ReduceOp
from scaleout.core.distribution import Distribution
from scaleout.core.env import Environment, attach, init
from scaleout.core.errors import (
    CommunicationError,
    CommunicationTimeout,
    NotInitializedError,
    PeerFailedError,
    ScaleoutError,
)
from scaleout.core.grid import Grid, GroupType
from scaleout.core.request import Request

__all__ = [
    "Communicator", "ReduceOp", "Distribution", "Environment", "attach", "init", "Grid",
    "GroupType", "Request", "ScaleoutError", "CommunicationError", "CommunicationTimeout",
    "NotInitializedError", "PeerFailedError",
]
