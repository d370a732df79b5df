"""Spatial parallelism: activations split along dim 2 (height, or depth) across the model group."""

from scaleout.pytorch.spatial.conv import SpatialConv, halo_exchange, split_rows
from scaleout.pytorch.spatial.convert import spatial_parallel
from scaleout.pytorch.spatial.norm import SpatialBatchNorm, SpatialGlobalAvgPool
from scaleout.pytorch.spatial.pool import SpatialPool

__all__ = ["SpatialBatchNorm", "SpatialConv", "SpatialGlobalAvgPool", "SpatialPool",
           "halo_exchange", "split_rows", "spatial_parallel"]
