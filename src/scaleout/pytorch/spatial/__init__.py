"""Spatial parallelism: activations split along the height across the model group."""

from scaleout.pytorch.spatial.conv import (
    SpatialConv,
    SpatialGlobalAvgPool,
    halo_exchange,
    split_rows,
)

__all__ = ["SpatialConv", "SpatialGlobalAvgPool", "halo_exchange", "split_rows"]
