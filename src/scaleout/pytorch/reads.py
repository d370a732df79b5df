"""Parameters read outside their own module's forward, found in the first forward.

In overlap mode a layer's update is applied in its module's forward pre-hook (``updates``).
A parameter can be read before that hook runs: ``nn.MultiheadAttention`` reads
``out_proj.weight`` itself and never calls ``out_proj``; a weight shared with a module that
runs earlier belongs to the module registered first; a parent's forward may compute
``F.linear(x, self.fc.weight)`` or a penalty on a child's weight before calling the child.
Such a read would see last step's weight (or, once the update lands in place, autograd's
"modified by an inplace operation"). :func:`find_early_reads` runs the first forward with a
torch function mode that sees every tensor each torch call receives, and with hooks on every
module that keep the stack of running modules; a read of a layer's parameter while that
layer's module is not on the stack names the innermost running module, whose pre-hook then
completes the layer's update first. Reads of metadata (shape, dtype, ``size()``) do not count.

DataParallel watches its forwards up to the first training one (grad enabled, training mode;
after it, the hooks cost nothing): a model whose first training forward does not read a
parameter where a later one does is not covered (docs/scheduling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from scaleout.pytorch.modules import Layer

__all__ = ["find_early_reads"]

# Calls that read a tensor's metadata, not its values.
_METADATA = frozenset({"size", "dim", "numel", "nelement", "stride", "element_size",
                       "is_contiguous", "is_floating_point", "is_complex", "storage_offset",
                       "data_ptr", "__len__", "ndimension", "get_device"})
_VALUE_GETTERS = frozenset({"data"})  # property reads that hand out the values


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: .shape, .dtype, .grad ... (.data reads the values)
        return getattr(getattr(func, "__self__", None), "__name__", "") in _VALUE_GETTERS
    return name not in _METADATA


class _Watch(TorchFunctionMode):
    def __init__(self, owner: dict[int, Layer], stack: list[nn.Module]) -> None:
        super().__init__()
        self._owner, self._stack = owner, stack
        self.early: dict[int, tuple[nn.Module, list[Layer]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._stack and _reads_values(func):
            for leaf in tree_leaves((args, kwargs)):
                layer = self._owner.get(id(leaf))
                if layer is not None and not any(m is layer.module for m in self._stack):
                    reader = self._stack[-1]
                    layers = self.early.setdefault(id(reader), (reader, []))[1]
                    if layer not in layers:
                        layers.append(layer)
        return func(*args, **kwargs)


def find_early_reads(root: nn.Module, layers: list[Layer], run: Callable[[], Any]
                     ) -> tuple[Any, list[tuple[nn.Module, list[Layer]]]]:
    """Call ``run()`` (the first forward of ``root``) and find the reads described above.

    Returns:
        ``run()``'s result, and per module that read another layer's parameters while that
        layer's module was not running: the module and those layers, in the order found.
    """
    owner = {id(p): layer for layer in layers for p in layer.params}
    stack: list[nn.Module] = []

    def enter(module: nn.Module, _inputs: Any) -> None:
        stack.append(module)

    def leave(module: nn.Module, _inputs: Any, _output: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    handles = []  # on root's modules only (global hooks would make torch.compile warn)
    for module in root.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    watch = _Watch(owner, stack)
    try:
        with watch:
            result = run()
    finally:
        for handle in handles:
            handle.remove()
    return result, list(watch.early.values())
