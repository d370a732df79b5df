"""Row-mixing torch calls on a spatially split activation, found in the first forward.

``spatial_parallel`` converts the layers it knows; a forward can still mix rows itself:
``x.mean((2, 3))`` or ``F.adaptive_avg_pool2d(x, 1)`` for the global pool, ``F.interpolate``
with a smooth mode or a fixed size, ``F.pad`` of the rows, ``F.group_norm``, a functional
convolution or a softmax along the split dimension. On a block of rows each of these
computes something else than on the whole sample, and nothing fails.
:func:`watch_first_forward` runs the model's first forward under a torch function mode that
follows which tensors are split (the model's inputs of three or more dimensions, whatever is
computed from them, the spatial layers' outputs; a global pool's output is whole) and raises
``ValueError`` at the first row-mixing call on one, naming the call and the module it ran
in. The spatial layers' own calls are theirs to get right and are not looked at. A reduction
over every dimension (a loss) is not a row-mixing call here: docs/hybrid.md says how to
scale a loss per position.

Only the first forward is watched, and not at all under ``SCALEOUT_CHECK=0``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from scaleout.pytorch.spatial.conv import SpatialConv
from scaleout.pytorch.spatial.norm import SpatialBatchNorm, SpatialGlobalAvgPool
from scaleout.pytorch.spatial.pool import SpatialPool

__all__ = ["watch_first_forward", "row_mixing", "resizing_mixes_rows", "padding_mixes_rows"]

_SPATIAL = (SpatialConv, SpatialBatchNorm, SpatialGlobalAvgPool, SpatialPool)

#: fixed-window pools: parameter names after the input, in order
_POOL_ARGS = {
    "max_pool2d": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "max_pool3d": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "max_pool2d_with_indices": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "max_pool3d_with_indices": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "avg_pool2d": ("kernel_size", "stride", "padding", "ceil_mode"),
    "avg_pool3d": ("kernel_size", "stride", "padding", "ceil_mode"),
}
_POOL_ARGS.update({name: ("kernel_size", "stride", "padding", "ceil_mode")
                   for name in ("avg_pool1d",)})
_POOL_ARGS.update({name: ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
                   for name in ("max_pool1d", "max_pool1d_with_indices")})
_POOLS_ACROSS = frozenset({"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                           "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
                           "lp_pool1d", "lp_pool2d", "lp_pool3d",
                           "fractional_max_pool2d", "fractional_max_pool3d"})
_MIXING = frozenset({"group_norm", "instance_norm", "local_response_norm", "fold", "unfold",
                     "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv1d",
                     "einsum"})  # (einsum: which letter is dim 2's is not followed)
#: calls along one dimension: (position of ``dim`` counting the input, its default)
_ALONG = {name: (1, None) for name in (
    "mean", "sum", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax",
    "argmin", "median", "std", "var", "std_mean", "var_mean", "logsumexp", "all", "any",
    "count_nonzero", "softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin")}
_ALONG.update({"sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "kthvalue": (2, -1),
               "mode": (1, -1), "logcumsumexp": (1, None), "norm": (2, None),
               "linalg_vector_norm": (2, None), "normalize": (2, 1), "quantile": (2, None),
               "nanquantile": (2, None), "cat": (1, 0), "concat": (1, 0), "concatenate": (1, 0)})
#: calls that repeat a tensor: the factor of dim 2 (sizes aligned from the last dim)
_REPEATING = frozenset({"repeat", "tile"})
#: calls that pick, shift or cut along one dimension: (position of it counting the input, its
#: name, its default; ``None``: the flattened tensor, which mixes rows too)
_PICKING = {"narrow": (1, "dim", 0), "select": (1, "dim", 0), "index_select": (1, "dim", 0),
            "gather": (1, "dim", 0), "take_along_dim": (2, "dim", None), "flip": (1, "dims", ()),
            "roll": (2, "dims", None), "diff": (2, "dim", -1), "split": (2, "dim", 0),
            "chunk": (2, "dim", 0), "tensor_split": (2, "dim", 0), "unbind": (1, "dim", 0)}
#: calls that reshape or reorder dimensions: judged by where dim 2 ends up
_RESHAPING = frozenset({"reshape", "view", "flatten", "unflatten", "view_as", "reshape_as"})
_REORDERING = frozenset({"transpose", "swapaxes", "swapdims", "permute", "movedim",
                         "moveaxis", "t"})


def _arg(args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str,
         default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


def _pool_tiles(name: str, x: torch.Tensor, args: Sequence[Any],
                kwargs: dict[str, Any]) -> bool:
    """Whether a functional fixed-window pool's windows tile this block (as SpatialPool's)."""
    names = _POOL_ARGS[name]
    get = {n: _arg(args, kwargs, i + 1, n, None) for i, n in enumerate(names)}
    kernel = _first(get["kernel_size"])
    stride = _first(get["stride"]) or kernel
    padding, dilation = _first(get["padding"] or 0), _first(get.get("dilation") or 1)
    return ((stride, padding, dilation) == (kernel, 0, 1) and not get["ceil_mode"]
            and x.shape[2] % kernel == 0)


def _moves_rows(name: str, x: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any],
                result: Any) -> bool:
    """Whether a reshape or reorder leaves dim 2 anywhere but at dim 2, whole and alone."""
    if name in _RESHAPING:
        shape = tuple(getattr(result, "shape", ()))
        return not (len(shape) > 2 and shape[2] == x.shape[2]
                    and shape[0] * shape[1] == x.shape[0] * x.shape[1])
    rank = x.dim()
    if name in ("transpose", "swapaxes", "swapdims"):
        pair = {_arg(args, kwargs, 1, "dim0", 0) % rank, _arg(args, kwargs, 2, "dim1", 0) % rank}
        return 2 in pair and len(pair) == 2
    if name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else (
            args[1:] or kwargs.get("dims", ()))
        return len(order) > 2 and order[2] % rank != 2
    if name in ("movedim", "moveaxis"):
        source, destination = (_arg(args, kwargs, 1, "source", ()),
                               _arg(args, kwargs, 2, "destination", ()))
        source, destination = ([d % rank for d in (v if isinstance(v, (tuple, list)) else (v,))]
                               for v in (source, destination))
        order: list[int | None] = [None] * rank  # the result's dims, as the input's
        for src, dst in zip(source, destination):
            order[dst] = src
        rest = iter(d for d in range(rank) if d not in source)
        return [d if d is not None else next(rest) for d in order][2] != 2
    return name == "t"


def _picks_rows(name: str, x: torch.Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a pick / shift / cut call works along dim 2 (or on the flattened tensor)."""
    position, param, default = _PICKING[name]
    dim = _arg(args, kwargs, position, param, default)
    if dim is None:
        return True
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return any(isinstance(d, int) and d % x.dim() == 2 for d in dims)


def _indexes_rows(x: torch.Tensor, args: Sequence[Any]) -> bool:
    """Whether ``x[index]`` takes less than every row (dim 2 indexed, sliced or cropped)."""
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if any(item is None for item in index):
        return False  # (a new axis moves the dims: not followed)
    dots = [i for i, item in enumerate(index) if item is Ellipsis]  # (``is``: tensors inside)
    if dots:
        at = dots[0]
        index = index[:at] + (slice(None),) * (x.dim() - len(index) + 1) + index[at + 1:]
    return len(index) > 2 and not (isinstance(index[2], slice) and index[2] == slice(None))


def resizing_mixes_rows(mode: str, size: Any, scale_factor: Any) -> str | None:
    """Why ``F.interpolate`` (or ``nn.Upsample``) with these arguments mixes the rows of a
    block split along dim 2, or ``None``: only nearest with a whole scale factor along dim 2
    copies each row to rows of its own block (``floor(i / s)``)."""
    if mode != "nearest":
        return f"interpolates across rows in mode {mode!r}"
    if size is not None:  # the whole sample's size: each block would be resized to it
        return "resizes to a fixed size, the whole sample's, given to each block"
    factor = _first(scale_factor)
    if factor is not None and not float(factor).is_integer():
        return f"scales dim 2 by {factor}, not a whole number: its rows straddle the blocks"
    return None


def padding_mixes_rows(pad: Sequence[int], dims: int) -> str | None:
    """Why ``F.pad(x, pad)`` on a ``dims``-dimensional ``x`` split along dim 2 mixes its rows,
    or ``None`` (it pads other dims only: each row on its own). ``pad`` holds a pair per dim
    from the last backwards, so dim 2's pair is the ``dims - 3``'th."""
    at = 2 * (dims - 3)
    return ("pads dim 2, whose edges only the first and last blocks hold" if any(pad[at: at + 2])
            else None)


def row_mixing(name: str, x: torch.Tensor, args: Sequence[Any],
               kwargs: dict[str, Any], result: Any = None) -> str | None:
    """Why the call ``name(*args, **kwargs)`` (which gave ``result``) mixes the rows of ``x``
    (split along dim 2), or ``None`` when it computes each row, or each tiled window, on its
    own and leaves the rows at dim 2."""
    if name in _PICKING and _picks_rows(name, x, args, kwargs):
        return "picks, shifts or cuts along dim 2 (this rank's rows only)"
    if name == "__getitem__" and _indexes_rows(x, args):
        return "indexes dim 2 (this rank's rows only)"
    if (name in _RESHAPING or name in _REORDERING) and _moves_rows(name, x, args, kwargs, result):
        return "merges or moves dim 2 (the split rows) into other dimensions"
    if name in _POOL_ARGS:
        return None if _pool_tiles(name, x, args, kwargs) else (
            "pools windows that do not tile this rank's block of rows")
    if name in _POOLS_ACROSS:
        return "pools across the split rows"
    if name in _MIXING:
        return "mixes neighbouring rows or normalises over the sample"
    if name == "interpolate":
        return resizing_mixes_rows(_arg(args, kwargs, 3, "mode", "nearest"),
                                   _arg(args, kwargs, 1, "size", None),
                                   _arg(args, kwargs, 2, "scale_factor", None))
    if name == "pad":
        return padding_mixes_rows(_arg(args, kwargs, 1, "pad", ()), x.dim())
    if name == "layer_norm":
        shape = _arg(args, kwargs, 1, "normalized_shape", ())
        return "normalises over two or more dims" if len(tuple(
            shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))) >= 2 else None
    if name in ("conv2d", "conv3d"):
        weight = _arg(args, kwargs, 1, "weight", None)
        stride = _first(_arg(args, kwargs, 3, "stride", 1))
        if stride != 1:  # (each block's first row would start the stride anew)
            return "convolves with a stride along the split rows"
        return ("convolves with a kernel of more than one row" if isinstance(
            weight, torch.Tensor) and weight.dim() >= 3 and weight.shape[2] > 1 else None)
    if name == "linear" and x.dim() == 3:
        return "applies a weight along dim 2, the split rows"
    if name == "batch_norm" and (_arg(args, kwargs, 5, "training", False)
                                 or _arg(args, kwargs, 1, "running_mean", None) is None):
        return "normalises over the sample (batch statistics)"
    if name in _REPEATING:
        sizes = args[1:] if len(args) > 2 or not isinstance(_arg(args, kwargs, 1, "dims", 1),
                                                               (tuple, list)) else args[1]
        sizes = tuple(sizes) or tuple(kwargs.get("dims", kwargs.get("repeats", ())))
        at = len(sizes) - x.dim() + 2  # (sizes align with the input's dims from the last)
        return ("repeats the split rows" if 0 <= at < len(sizes) and sizes[at] != 1
                else None)
    if name == "stack" and _arg(args, kwargs, 1, "dim", 0) % (x.dim() + 1) <= 2:
        return "stacks at or before dim 2, moving the split rows"
    if name in _ALONG:
        position, default = _ALONG[name]
        dim = _arg(args, kwargs, position, "dim", default)
        if dim is None or isinstance(dim, torch.Tensor):  # every dim (a loss), elementwise
            return None
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if not all(isinstance(d, int) for d in dims):  # (named dims: not ours to judge)
            return None
        if any(d % x.dim() == 2 for d in dims):
            return "reduces or orders along dim 2"
    return None


#: a whole tensor that needs a gradient meets a split one (a parameter outside the spatial
#: layers, a squeeze-and-excitation gate from the global pool): its gradient would be this
#: rank's rows' share alone (before stop 48: trained wrong and the ranks' copies apart)
_WHOLE_WITH_SPLIT = ("combines a whole tensor that needs a gradient (a parameter, or a value "
                     "from the global pool) with one split along dim 2, so that tensor's "
                     "gradient would be this rank's rows' share alone")

_ADVICE = ("use the layer form that spatial_parallel converts (nn.AdaptiveAvgPool2d(1) for a "
           "global pool, nn.MaxPool2d/AvgPool2d with windows that tile, nn.Conv2d, "
           "nn.BatchNorm2d), or move the call after the global pool")


class _Watch(TorchFunctionMode):
    def __init__(self, stack: list[str], inside: list[int]) -> None:
        super().__init__()
        self._split: dict[int, weakref.ref[torch.Tensor]] = {}
        self._stack, self._inside = stack, inside

    def mark(self, value: Any) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._split[id(leaf)] = weakref.ref(leaf)

    def unmark(self, value: Any) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._split.pop(id(leaf), None)

    def is_split(self, leaf: Any) -> bool:
        ref = self._split.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
        return ref is not None and ref() is leaf

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self._inside[0]:  # a spatial layer's own calls
            return result
        leaves = tree_leaves((args, kwargs))
        split = [leaf for leaf in leaves if self.is_split(leaf)]
        if split:
            name = getattr(func, "__name__", "")
            x = args[0] if args and self.is_split(args[0]) else split[0]
            reason = row_mixing(name, x, args, kwargs, result) if x.dim() >= 3 else None
            if reason is None and x.dim() >= 3 and any(  # (a split 0-dim value is a loss)
                    isinstance(leaf, torch.Tensor) and leaf.requires_grad
                    and not self.is_split(leaf) for leaf in leaves):
                reason = _WHOLE_WITH_SPLIT
            if reason is not None:
                raise ValueError(
                    f"spatial_parallel: {name}() in {self._stack[-1]} {reason}, on a tensor "
                    f"split along dim 2 across the model group (shape {tuple(x.shape)} here): "
                    f"it would "
                    f"compute on each rank's block alone, a different result; {_ADVICE}. "
                    "SCALEOUT_CHECK=0 turns this check off.")
            self.mark(result)
        return result


def watch_first_forward(module: nn.Module) -> None:
    """Run ``module``'s next forward under the watch (see the module docstring), then stop."""
    original: Callable[..., Any] = module.forward

    def watched(*args: Any, **kwargs: Any) -> Any:
        del module.forward  # (the instance attribute: later forwards are the class's)
        stack = [type(module).__name__]  # (this is its forward: its own hooks have run)
        inside = [0]
        mode = _Watch(stack, inside)
        handles = []
        for name, sub in module.named_modules():
            if sub is module:
                continue
            label = f"{name} ({type(sub).__name__})"
            spatial = isinstance(sub, _SPATIAL)
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, label=label, spatial=spatial: _enter(stack, inside, label, spatial)))
            handles.append(sub.register_forward_hook(
                lambda m, a, out, spatial=spatial: _leave(mode, stack, inside, m, out, spatial)))
        mode.mark([leaf for leaf in tree_leaves((args, kwargs))  # (samples: N, C, H, ...)
                   if isinstance(leaf, torch.Tensor) and leaf.dim() >= 3])
        try:
            with mode:
                return original(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    module.forward = watched  # type: ignore[method-assign]


def _enter(stack: list[str], inside: list[int], label: str, spatial: bool) -> None:
    stack.append(label)
    inside[0] += spatial


def _leave(mode: _Watch, stack: list[str], inside: list[int], sub: nn.Module, out: Any,
           spatial: bool) -> None:
    stack.pop()
    if spatial:
        inside[0] -= 1
        if not inside[0]:
            (mode.unmark if isinstance(sub, SpatialGlobalAvgPool) else mode.mark)(out)
