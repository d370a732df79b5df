"""Turn a plain CNN into its spatially split form (dim 2 split across the model group)."""

from __future__ import annotations

import warnings

from torch import nn

from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.modules import broadcast_tensors, refuse_meta
from scaleout.pytorch.placement import placement_of
from scaleout.pytorch.spatial.conv import SpatialConv
from scaleout.pytorch.spatial.norm import SpatialBatchNorm, SpatialGlobalAvgPool
from scaleout.pytorch.spatial.pool import FIXED_POOLS, SpatialPool
from scaleout.pytorch.spatial.watch import (
    padding_mixes_rows,
    resizing_mixes_rows,
    watch_first_forward,
)
from scaleout.pytorch.split_regions import fork_dropouts, split_dropouts

__all__ = ["spatial_parallel"]


def _pools_rows(module: nn.Module) -> bool:
    """An adaptive pool whose windows along dim 2 depend on the whole (unsplit) size."""
    if not isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
        return False
    size = module.output_size
    return (size[0] if isinstance(size, tuple) else size) is not None


#: Layers whose output rows depend on their neighbours' or on the whole sample's, and which
#: have no split form here: on a block they compute something else.
MIXES_ROWS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.GroupNorm,
              nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
              nn.Fold, nn.Unfold,
              # 1-D layers: an (N, C, L) sample is split along L, the dim they work along
              # (before stop 48 left as they were: 0.5-0.8 off, some without a warning)
              nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d,
              nn.AdaptiveMaxPool1d, nn.LPPool1d)
#: Padding layers: ``padding`` holds a pair per padded dim from the last backwards, and the
#: last pair pads the first spatial dim (dim 2) of an ``(N, C, *spatial)`` input.
PADS = (nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d,
        nn.ZeroPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReflectionPad3d,
        nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d, nn.CircularPad1d,
        nn.CircularPad2d, nn.CircularPad3d)


def _mixes_rows(module: nn.Module) -> str | None:
    """Why ``module`` mixes the split rows, or ``None``."""
    if isinstance(module, nn.Upsample):  # nearest by a whole factor copies each row: local
        return resizing_mixes_rows(module.mode, module.size, module.scale_factor)
    if isinstance(module, PADS):  # pads dim 2, or only the others (each row on its own)
        return padding_mixes_rows(module.padding, len(module.padding) // 2 + 2)
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) >= 2:  # (over the
        return "normalises over two or more dims"  # last dim alone: each row on its own)
    return "or normalises over the sample" if isinstance(module, MIXES_ROWS) else None


def _unknown_with_parameters(module: nn.Module) -> bool:
    """Parameters of its own and none of the layers a CNN's head is made of after its global
    pool (linears, a tensor-parallel layer's shards): a PReLU, a custom layer."""
    own = list(module.parameters(recurse=False))
    return bool(own) and not isinstance(module, nn.Linear) and all(
        placement_of(p) is None for p in own)


def _global_pool(module: nn.Module) -> bool:
    if not isinstance(module, (nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)):
        return False
    size = module.output_size
    return all(s == 1 for s in (size if isinstance(size, tuple) else (size,)))


def _split_rows_dropouts(module: nn.Module) -> list[str]:
    """The ``nn.Dropout`` modules the forward calls on split rows: on what is computed from a
    spatial layer's output (a conv, batch norm or fixed pool, before or after conversion),
    up to a global pool."""
    starts, ends = set(), set()
    for name, child in module.named_modules():
        if isinstance(child, (nn.Conv2d, nn.Conv3d, nn.BatchNorm2d, nn.BatchNorm3d, FIXED_POOLS,
                              SpatialConv, SpatialBatchNorm, SpatialPool)):
            starts.add(name)
        elif _global_pool(child) or isinstance(child, SpatialGlobalAvgPool):
            ends.add(name)
    return split_dropouts(module, starts, ends, caller="spatial_parallel") if starts else []


def spatial_parallel(module: nn.Module, distribution: Distribution) -> nn.Module:
    """Replace, in place, every ``nn.Conv2d``/``Conv3d`` by a :class:`SpatialConv`, every
    ``nn.BatchNorm2d``/``3d`` by a :class:`SpatialBatchNorm`, every global
    ``nn.AdaptiveAvgPool2d/3d(1)`` by a :class:`SpatialGlobalAvgPool` and every
    ``MaxPool``/``AvgPool`` 2-D/3-D by a :class:`SpatialPool` (which checks that its windows
    tile each rank's block), keeping the weights
    (broadcast from model-group rank 0 first; a tensor-parallel layer's shards stay as they
    are). Feed each rank its block of every sample (:func:`split_rows`). Layers that work on
    each block unchanged (activations, pools of one row at a time, nearest upsampling by a
    whole factor, padding of the other dims) are left as they are; a layer with parameters
    it does not know is left with a warning (right only where its input is whole, after the
    global pool). Calls in a forward that mix the split rows (``x.mean((2, 3))``,
    ``F.adaptive_avg_pool2d``, ``F.interpolate`` other than nearest by a whole factor,
    ``F.pad`` of dim 2, ...) are a ValueError at the first forward (``spatial/watch.py``;
    not under ``SCALEOUT_CHECK=0``). An ``nn.Dropout`` the forward calls on split rows (after
    a spatial layer, before the global pool) becomes a
    :class:`~scaleout.pytorch.SplitRegionDropout`, which draws a mask of its own on each
    model rank (a channel dropout, ``Dropout2d``, drops whole channels alike on every rank).

    Args:
        module: the plain model (changed in place and returned).
        distribution: the grid; dim 2 is split across its MODEL group.

    Returns:
        ``module``.

    Raises:
        ValueError: a convolution that cannot be split (stride, dilation, even kernel,
            padding), a max or average pool whose windows do not tile dim 2 (stride =
            kernel, no padding), an adaptive pool across dim 2 other than a global
            average, or a layer that mixes rows (:data:`MIXES_ROWS`, upsampling other than
            nearest by a whole factor along dim 2, a padding layer (:data:`PADS`) that pads
            dim 2, a LayerNorm over two or more dims), named; nothing is converted
            then. At a forward: a fixed pool whose window does not divide a rank's block
            of rows; at the first forward, a call in a forward that mixes the split rows.
    """
    comm = distribution.communicator(GroupType.MODEL)
    if comm.size > 1:  # (placed tensors, a tensor-parallel layer's shards, are left alone)
        refuse_meta(module, "spatial_parallel")
        broadcast_tensors(comm, [*(p for p in module.parameters() if placement_of(p) is None),
                                 *module.buffers()])
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    unknown: list[str] = []  # layers with parameters it does not know
    for parent_name, parent in module.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, (nn.Conv2d, nn.Conv3d)):
                new: nn.Module = SpatialConv(child, distribution=distribution, name=name)
            elif isinstance(child, (nn.BatchNorm2d, nn.BatchNorm3d)):
                new = SpatialBatchNorm(child, distribution=distribution, name=name)
            elif isinstance(child, FIXED_POOLS):
                new = SpatialPool(child, name=name)
            elif _global_pool(child):
                new = SpatialGlobalAvgPool(distribution=distribution)
            elif _pools_rows(child):
                raise ValueError(f"spatial_parallel: layer {name} ({type(child).__name__}) pools "
                                 "across the split rows; only a global average pool "
                                 "(output size 1) can be split")
            elif reason := _mixes_rows(child):
                raise ValueError(f"spatial_parallel: layer {name} ({type(child).__name__}) "
                                 f"mixes rows ({reason}) and has no split form; it "
                                 "would compute on each rank's block alone")
            else:
                if _unknown_with_parameters(child):
                    unknown.append(f"{name} ({type(child).__name__})")
                continue
            replacements.append((parent, child_name, new))
    if unknown:  # right after the global pool (whole rows on every rank), wrong before it
        warnings.warn(
            f"spatial_parallel leaves {', '.join(unknown)} as it is: its parameters' gradients "
            "are right only where its input is whole on every model rank (after a global "
            "pool); on a block of rows each rank would hold its block's share", stacklevel=2)
    dropouts = _split_rows_dropouts(module) if comm.size > 1 else []
    for parent, child_name, new in replacements:
        setattr(parent, child_name, new)
    fork_dropouts(module, dropouts, distribution)
    if comm.size > 1 and comm.check_consistency != "off":
        watch_first_forward(module)  # row-mixing calls written in a forward: a ValueError
    return module
