"""Per-layer parameter and gradient sizes, in forward order.

Benchmarks and the simulator need, for every layer that owns parameters, how
many gradient bytes it produces and in what order layers run. A "layer" here is
a module that *directly* owns trainable parameters (``recurse=False``); a
parameter shared by several modules (e.g. a tied LM head) is counted once, for
the first module that owns it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["LayerSize", "layer_sizes", "total_grad_bytes"]


class LayerSize(NamedTuple):
    """One layer's trainable parameters: ``(name, param_count, grad_bytes)``."""

    name: str
    """Qualified module name as in ``model.named_modules()`` ("" for the root)."""
    param_count: int
    """Number of trainable scalars the layer owns directly."""
    grad_bytes: int
    """Bytes of its gradients (``numel * element_size`` of each parameter)."""


def _direct_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _forward_order(model: nn.Module, example_inputs: Any) -> list[str]:
    """Names of modules with direct parameters, in the order their forward starts."""
    order: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if _direct_params(module):
            handles.append(
                module.register_forward_pre_hook(lambda _m, _a, name=name: order.append(name))
            )
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example_inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    seen: set[str] = set()
    return [n for n in order if not (n in seen or seen.add(n))]


def layer_sizes(model: nn.Module, example_inputs: Any = None) -> list[LayerSize]:
    """List the layers of ``model`` that own trainable parameters.

    Args:
        model: any module.
        example_inputs: if given, ``model(example_inputs)`` is run once (eval
            mode, no grad) and layers are listed in the order their forward
            starts; layers not called come last in registration order. If
            ``None``, registration order is used (which is forward order for
            every reference workload).

    Returns:
        ``[LayerSize(name, param_count, grad_bytes), ...]``; layers without
        trainable parameters are omitted.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.

    Example:
        >>> layer_sizes(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))
        [LayerSize(name='0', param_count=8, grad_bytes=32)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if _direct_params(m)]
    if example_inputs is not None:
        traced = _forward_order(model, example_inputs)
        names = traced + [n for n in names if n not in set(traced)]
    seen: set[int] = set()
    sizes = []
    for name in names:
        count = nbytes = 0
        for param in _direct_params(modules[name]):
            if id(param) in seen:
                continue
            seen.add(id(param))
            count += param.numel()
            nbytes += param.numel() * param.element_size()
        if count:
            sizes.append(LayerSize(name, count, nbytes))
    return sizes


def total_grad_bytes(model: nn.Module) -> int:
    """Bytes of all trainable gradients of ``model`` (shared parameters once)."""
    return sum(size.grad_bytes for size in layer_sizes(model))
