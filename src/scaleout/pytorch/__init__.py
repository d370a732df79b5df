"""The PyTorch front end: DataParallel and DistributedOptimizer."""

from scaleout.pytorch.data_parallel import DataParallel
from scaleout.pytorch.optimizer import MODES, DistributedOptimizer, optimizer_state_bytes

__all__ = ["DataParallel", "DistributedOptimizer", "MODES", "optimizer_state_bytes"]
