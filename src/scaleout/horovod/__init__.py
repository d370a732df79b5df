"""Horovod's PyTorch API on scaleout: change ``import horovod.torch as hvd`` to
``import scaleout.horovod as hvd`` and run the script with ``scaleout run -n N``, torchrun,
mpirun or srun. See docs/horovod.md for what is supported and what differs.

Example (2 ranks):
    >>> import scaleout.horovod as hvd
    >>> hvd.init()
    >>> hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    tensor([1.])
"""

from scaleout.horovod import elastic
from scaleout.horovod.allreduce import (
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from scaleout.horovod.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from scaleout.horovod.built import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from scaleout.horovod.collectives import (
    allgather_async,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    reducescatter_async,
)
from scaleout.horovod.compression import Compression
from scaleout.horovod.context import (
    add_process_set,
    cross_rank,
    cross_size,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from scaleout.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt, TensorMismatchError
from scaleout.horovod.grouped import grouped_allgather_async, grouped_reducescatter_async
from scaleout.horovod.handles import poll, synchronize
from scaleout.horovod.join import join
from scaleout.horovod.objects import allgather_object, broadcast_object
from scaleout.horovod.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from scaleout.horovod.optimizer import DistributedOptimizer
from scaleout.horovod.parameters import broadcast_optimizer_state, broadcast_parameters
from scaleout.horovod.process_sets import ProcessSet, global_process_set
from scaleout.horovod.startup import init
from scaleout.horovod.sync_batch_norm import SyncBatchNorm
from scaleout.horovod.timeline import start_timeline, stop_timeline

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll", "join", "barrier",
    "ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "SyncBatchNorm", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "HorovodInternalError", "HostsUpdatedInterrupt", "TensorMismatchError", "elastic",
]
