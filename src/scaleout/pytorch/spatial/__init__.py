"""Spatial parallelism: activations split along dim 2 (height, or depth) across the model group."""

from scaleout.pytorch.spatial.conv import SpatialConv, halo_exchange, split_rows
from scaleout.pytorch.spatial.convert import spatial_parallel
from scaleout.pytorch.spatial.norm import SpatialBatchNorm, SpatialGlobalAvgPool

__all__ = ["SpatialBatchNorm", "SpatialConv", "SpatialGlobalAvgPool", "halo_exchange",
           "split_rows", "spatial_parallel"]
