"""Sharded embedding tables (DLRM / TorchRec style): a planner, the collection, a row-wise
sparse optimizer, updates fused into backward, a loader wrapper that prefetches the next
batch's ids."""

from scaleout.pytorch.embeddings.collection import EmbeddingCollection
from scaleout.pytorch.embeddings.fused import FusedRowWiseAdagrad, FusedSGD
from scaleout.pytorch.embeddings.optim import RowWiseAdagrad
from scaleout.pytorch.embeddings.prefetching import prefetching
from scaleout.pytorch.embeddings.planner import (
    COLUMN_WISE,
    ROW_WISE,
    ShardingPlan,
    TableSpec,
    plan_tables,
    row_block,
)

__all__ = ["EmbeddingCollection", "RowWiseAdagrad", "FusedSGD", "FusedRowWiseAdagrad",
           "prefetching", "ShardingPlan", "TableSpec", "plan_tables",
           "ROW_WISE", "COLUMN_WISE", "row_block"]
