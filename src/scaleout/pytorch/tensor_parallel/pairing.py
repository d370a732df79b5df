"""Whether two ``nn.Linear`` children of one module may be split as a column/row pair.

A column-parallel layer leaves each rank a slice of the features; the row-parallel layer
after it sums the slices' products. That is the original network only when everything in
between acts on each feature alone (ReLU, GELU, dropout, scaling by a number): a softmax or a
normalisation over the features, or another use of the first layer's output, needs all of
them. In an ``nn.Sequential`` the layers in between are its children; in any other module the
forward is traced with ``torch.fx`` to see them. What cannot be told is not paired.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ELEMENTWISE_MODULES", "elementwise_between"]

#: Layers that act on each feature alone (a column/row pair may have them in between).
ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.ELU,
                       nn.CELU, nn.SELU, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish,
                       nn.Hardsigmoid, nn.Softplus, nn.Dropout, nn.Identity)
_FUNCTIONS = {torch.relu, F.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, F.mish, F.elu,
              F.celu, F.selu, torch.tanh, F.tanh, torch.sigmoid, F.sigmoid, F.hardtanh,
              F.hardswish, F.hardsigmoid, F.softplus, F.dropout}
_METHODS = {"relu", "tanh", "sigmoid", "contiguous"}
_SCALINGS = {operator.mul, operator.truediv, torch.mul}


def elementwise_between(parent: nn.Module, first: str, second: str) -> bool | None:
    """Whether ``parent``'s child ``second`` reads ``first``'s output through elementwise
    steps only, and nothing else reads it; ``None`` when ``parent``'s forward cannot be
    traced."""
    if isinstance(parent, nn.Sequential):
        names = [n for n, _ in parent.named_children()]
        between = names[names.index(first) + 1: names.index(second)]
        return all(isinstance(parent.get_submodule(n), ELEMENTWISE_MODULES) for n in between)
    try:
        graph = torch.fx.symbolic_trace(parent).graph
    except Exception:  # noqa: BLE001 - any forward fx cannot follow: not told
        return None
    calls = {name: [n for n in graph.nodes if n.op == "call_module" and n.target == name]
             for name in (first, second)}
    if len(calls[first]) != 1 or len(calls[second]) != 1 or not calls[second][0].args:
        return False
    start, node = calls[first][0], calls[second][0].args[0]
    while True:
        if len(node.users) != 1:  # its value is needed whole elsewhere too
            return False
        if node is start:
            return True
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if len(inputs) != 1 or not _elementwise(parent, node):
            return False
        node = inputs[0]


def _elementwise(parent: nn.Module, node: Any) -> bool:
    if node.op == "call_module":
        return isinstance(parent.get_submodule(node.target), ELEMENTWISE_MODULES)
    if node.op == "call_method":
        return node.target in _METHODS
    if node.op == "call_function":
        if node.target in _FUNCTIONS:
            return True
        return node.target in _SCALINGS and any(
            isinstance(a, numbers.Number) for a in node.args)
    return False
