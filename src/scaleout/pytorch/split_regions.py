"""Which ``nn.Dropout`` modules of a model act on a split activation (a split region).

Between a column-parallel layer and its row-parallel layer (an MLP's hidden units, an
attention's heads) each rank of the model group holds a block of the activation, and so it
does on a spatial split's rows from the first spatial layer to the global pool. A dropout
there must draw a mask of its own on each rank (:class:`~scaleout.pytorch.model_rng.
SplitRegionDropout`); a dropout elsewhere acts on a replicated activation and must draw the
same mask on every rank, from the default generator.

:func:`split_dropouts` follows the data in a module's forward, traced with ``torch.fx``:
what is computed from a region's start (a column layer's or a spatial layer's output) is
split, up to its end (a row layer, a global pool), whose output is whole. An
``nn.Sequential`` is read in order of its children. A dropout module called on a split value
and also on a whole one is left alone, with a warning (its masks should differ across the
ranks in one place and agree in the other); so are a forward that cannot be traced, and
dropouts written as calls (``F.dropout``), which run under
:meth:`~scaleout.pytorch.model_rng.ModelParallelRNG.fork` by hand.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Mapping

import torch
from torch import nn

from scaleout.core.distribution import Distribution
from scaleout.pytorch.model_rng import ModelParallelRNG, SplitRegionDropout

__all__ = ["split_dropouts", "tensor_parallel_dropouts", "tensor_parallel_shared_parameters",
           "fork_dropouts"]

#: what a tensor's metadata reads: its shape is not split data (a view of a split tensor
#: sized by ``x.size(-1)`` is split because ``x`` is, not because of the size)
_METADATA = {"size", "dim", "numel", "shape", "dtype", "device", "ndim", "is_cuda"}


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, stopping at scaleout's own layers too (a tensor-parallel or spatial
    layer exchanges activations: its forward is not traced into)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (type(m).__module__.startswith("scaleout.")
                or super().is_leaf_module(m, module_qualified_name))


def _dropout(module: nn.Module) -> bool:
    """An elementwise ``nn.Dropout`` (not one already on a split stream; the channel-wise
    ``Dropout1d/2d/3d`` zero a whole channel, which spans the ranks' blocks of a spatial
    split and must be dropped alike there)."""
    return type(module) is nn.Dropout


def _metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _METADATA
    return node.op == "call_function" and node.target is getattr and node.args[1] in _METADATA


def _in_order(parent: nn.Sequential, starts: Collection[str],
              ends: Collection[str]) -> tuple[set[str], set[str]]:
    split, whole, inside = set(), set(), False
    for name, child in parent.named_children():
        if name in starts:
            inside = True
        elif name in ends or any(end.startswith(f"{name}.") for end in ends):
            inside = False
        elif _dropout(child):
            (split if inside else whole).add(name)
    return split, whole


def _split_nodes(parent: nn.Module, starts: Collection[str],
                 ends: Collection[str]) -> tuple[list[torch.fx.Node], set[torch.fx.Node]] | None:
    """``parent``'s traced nodes, and those computed from a start's output without passing
    an end (the start itself excepted); ``None`` when the forward cannot be traced."""
    try:
        graph = _Tracer().trace(parent)
    except Exception:  # noqa: BLE001 - any forward fx cannot follow: not told
        return None
    marked: set[torch.fx.Node] = set()
    split: set[torch.fx.Node] = set()
    for node in graph.nodes:
        module = node.target if node.op == "call_module" else None
        if module in starts:
            marked.add(node)
        elif module not in ends and not _metadata(node) \
                and any(arg in marked for arg in node.all_input_nodes):
            marked.add(node)
            split.add(node)
    return list(graph.nodes), split


def _traced(parent: nn.Module, starts: Collection[str],
            ends: Collection[str]) -> tuple[set[str], set[str]] | None:
    found = _split_nodes(parent, starts, ends)
    if found is None:
        return None
    nodes, inside = found
    split, whole = set(), set()
    for node in nodes:
        if node.op == "call_module" and node.target not in {*starts, *ends} \
                and _dropout(parent.get_submodule(node.target)):
            (split if node in inside else whole).add(node.target)
    return split, whole


def _parameters_on_split(parent: nn.Module, starts: Collection[str],
                         ends: Collection[str]) -> set[str]:
    """The names (relative to ``parent``) of the parameters that its forward combines with
    split values: a module called on one (an ``nn.RMSNorm`` on split heads, a ``PReLU``
    between a column and a row layer), or a parameter read in the forward (a learnt
    temperature). Nothing when the forward cannot be traced."""
    if isinstance(parent, nn.Sequential):
        names, inside = set(), False
        for name, child in parent.named_children():
            inside = name in starts or (inside and name not in ends and not any(
                end.startswith(f"{name}.") for end in ends))
            if inside and name not in starts:
                names.update(f"{name}.{n}" for n, _ in child.named_parameters())
        return names
    found = _split_nodes(parent, starts, ends)
    names = set()
    for node in found[1] if found is not None else ():
        if node.op == "call_module":
            names.update(f"{node.target}.{n}"
                         for n, _ in parent.get_submodule(node.target).named_parameters())
        names.update(arg.target for arg in node.all_input_nodes if arg.op == "get_attr")
    params = dict(parent.named_parameters())
    return {n for n in names if n in params and params[n].requires_grad}


def split_dropouts(parent: nn.Module, starts: Collection[str], ends: Collection[str], *,
                   caller: str, where: str = "") -> list[str]:
    """The ``nn.Dropout`` modules of ``parent`` (names relative to it) that its forward calls
    on values computed from a start's output without passing an end.

    Args:
        parent: the module whose forward is followed.
        starts / ends: names (relative to ``parent``) of the modules whose outputs are
            split / whole again.
        caller: the converter's name, for warnings. where: ``parent``'s name, for warnings.

    Returns:
        The dropouts' names; none (with a warning) when ``parent`` holds a dropout but its
        forward cannot be traced.
    """
    if not any(_dropout(m) for m in parent.modules()):  # (nothing to find: not traced)
        return []
    label = f"{where or '<root>'} ({type(parent).__name__})"
    found = (_in_order(parent, starts, ends) if isinstance(parent, nn.Sequential)
             else _traced(parent, starts, ends))
    if found is None:
        warnings.warn(f"{caller}: the forward of {label} cannot be traced to see which of "
                      "its dropouts act on split activations; they draw the same mask on "
                      "every model rank there (run them under ModelParallelRNG.fork(), "
                      "docs/hybrid.md)", stacklevel=4)
        return []
    split, whole = found
    if split & whole:
        warnings.warn(f"{caller}: {label} calls {', '.join(sorted(split & whole))} on split "
                      "and on whole activations; it keeps the default generator (the same "
                      "mask on every model rank); use one dropout module for each",
                      stacklevel=4)
    return sorted(split - whole)


def _column_parents(module: nn.Module, plan: Mapping[str, str]) -> Iterator[
        tuple[str, nn.Module, set[str], set[str]]]:
    """Each module holding a column layer of ``plan``: its name, with a dot (``""`` for the
    root), the module, and the names relative to it of its column and row layers."""
    starts = {name for name, style in plan.items() if style in ("column", "qkv")}
    ends = {name for name, style in plan.items() if style == "row"}
    for where in sorted({name.rpartition(".")[0] for name in starts}):
        head = f"{where}." if where else ""
        mine = [{n[len(head):] for n in names if n.startswith(head)} for names in (starts, ends)]
        yield head, module.get_submodule(where), mine[0], mine[1]


def tensor_parallel_dropouts(module: nn.Module, plan: Mapping[str, str]) -> list[str]:
    """The dropouts between the plan's column layers and their row layers (qualified names),
    found in the forward of each module holding a column layer."""
    found: set[str] = set()
    for head, parent, starts, ends in _column_parents(module, plan):
        found.update(head + n for n in split_dropouts(
            parent, starts, ends, caller="tensor_parallel", where=head[:-1]))
    return sorted(found)


def tensor_parallel_shared_parameters(module: nn.Module, plan: Mapping[str, str]) -> list[str]:
    """The replicated parameters (qualified names) that the forward combines with the split
    activations between the plan's column layers and their row layers: each rank's gradient
    of one is its block's share only (a per-head ``RMSNorm`` on split heads, a learnt
    temperature on split attention scores)."""
    found: set[str] = set()
    for head, parent, starts, ends in _column_parents(module, plan):
        found.update(head + n for n in _parameters_on_split(parent, starts, ends))
    return sorted(found)


def fork_dropouts(module: nn.Module, names: Collection[str], distribution: Distribution) -> None:
    """Put a :class:`SplitRegionDropout` in place of each named dropout (on the MODEL group
    of ``distribution``)."""
    if not names:
        return
    rng = ModelParallelRNG(distribution)
    for name in names:
        where, _, child = name.rpartition(".")
        parent = module.get_submodule(where)
        setattr(parent, child, SplitRegionDropout.from_dropout(getattr(parent, child), rng))
