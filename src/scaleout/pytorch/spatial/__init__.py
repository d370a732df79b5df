"""Spatial parallelism: activations split along the height across the model group."""

from scaleout.pytorch.spatial.conv import (
    SpatialConv2d,
    SpatialGlobalAvgPool,
    halo_exchange,
    split_rows,
)

__all__ = ["SpatialConv2d", "SpatialGlobalAvgPool", "halo_exchange", "split_rows"]
