"""The PyTorch front end: DataParallel, DistributedOptimizer and model-parallel layers."""

from scaleout.pytorch.data_parallel import DataParallel
from scaleout.pytorch.embeddings import (
    COLUMN_WISE,
    ROW_WISE,
    EmbeddingCollection,
    FusedRowWiseAdagrad,
    FusedSGD,
    RowWiseAdagrad,
    ShardingPlan,
    TableSpec,
    plan_tables,
    prefetching,
)
from scaleout.pytorch.optimizer import MODES, DistributedOptimizer, optimizer_state_bytes
from scaleout.pytorch.replicas import ReplicaDivergenceError
from scaleout.pytorch.spatial import (
    SpatialBatchNorm,
    SpatialConv,
    SpatialGlobalAvgPool,
    SpatialPool,
    spatial_parallel,
    split_rows,
)
from scaleout.pytorch.tensor_parallel import (
    ColumnParallelLinear,
    ModelParallelRNG,
    RowParallelLinear,
    SplitRegionDropout,
    VocabParallelEmbedding,
    full_state_dict,
    load_full_state_dict,
    tensor_parallel,
)

__all__ = [
    "DataParallel", "DistributedOptimizer", "MODES", "optimizer_state_bytes",
    "ReplicaDivergenceError",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "tensor_parallel",
    "full_state_dict", "load_full_state_dict", "EmbeddingCollection", "RowWiseAdagrad",
    "FusedSGD", "FusedRowWiseAdagrad",
    "ShardingPlan", "TableSpec", "plan_tables", "prefetching", "ROW_WISE", "COLUMN_WISE", "SpatialConv",
    "SpatialGlobalAvgPool", "SpatialBatchNorm", "SpatialPool", "split_rows", "spatial_parallel",
    "ModelParallelRNG", "SplitRegionDropout",
]
