"""Turn a plain model into its tensor-parallel form, and gather it back for saving."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from scaleout.core import collectives
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.modules import broadcast_tensors, refuse_meta
from scaleout.pytorch.placement import Kind, placement_of
from scaleout.pytorch.tensor_parallel.pairing import elementwise_between
from scaleout.pytorch.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from scaleout.pytorch.split_regions import (
    fork_dropouts,
    tensor_parallel_dropouts,
    tensor_parallel_shared_parameters,
)

__all__ = ["tensor_parallel", "full_state_dict", "load_full_state_dict", "plan_tensor_parallel",
           "STYLES"]

#: What a plan may say of a layer ("qkv": a fused ``[q; k; v]`` projection, column parallel
#: block by block).
STYLES = ("column", "qkv", "row", "vocab", "replicate")
_QKV = ({"q", "query", "q_proj", "wq", "to_q"}, {"k", "key", "k_proj", "wk", "to_k"},
        {"v", "value", "v_proj", "wv", "to_v"})
_QKV_NAMES = set().union(*_QKV)
_OUT = ("out_proj", "o_proj", "out", "o", "proj", "c_proj", "dense", "wo")
_HEADS = ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads", "nhead",
          "num_key_value_heads", "n_kv_heads", "num_kv_heads",
          # the heads a rank holds, as LLaMA's reference code names them
          "n_local_heads", "n_local_kv_heads", "num_local_heads", "num_local_key_value_heads")
#: names of fused ``[q; k; v]`` projections: "column" would give rank 0 all of q, not a third
_FUSED = ("qkv", "c_attn", "query_key_value", "in_proj", "wqkv", "qkv_proj")


def _linears(parent: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in parent.named_children() if type(m) is nn.Linear]


def plan_tensor_parallel(module: nn.Module, *, embeddings: bool = False) -> dict[str, str]:
    """The default plan: which ``nn.Linear`` (and ``nn.Embedding``) becomes which layer.

    Rules, per module, on its direct ``nn.Linear`` children:
    - attention: children named q/k/v (``q``, ``query``, ``q_proj``, ``wq``, ...) are column
      parallel and the output projection (``out_proj``, ``o_proj``, ``out``, ``proj``,
      ``wo``, ...) row parallel, when the module has a head count;
    - otherwise consecutive children (registration order) are paired column then row when
      the first's ``out_features`` equals the second's ``in_features`` and only elementwise
      steps lie between them in the forward (MLP stacks, transformer MLPs;
      :mod:`~scaleout.pytorch.tensor_parallel.pairing`: an ``nn.Sequential``'s children, or
      any other module's forward traced with ``torch.fx``), except in a module with a head
      count and no q/k/v-named child (:func:`tensor_parallel` cannot tell its attention's
      projections there); an unpaired layer stays replicated (with a warning where the
      forward could not be traced); a fused ``[q; k; v]`` projection (``qkv``, ``c_attn``,
      ``query_key_value``, ``in_proj``, ``wqkv``, ``qkv_proj``) beside an output projection,
      in a module with a head count, is ``"qkv"`` (since stop 49; it stayed replicated): its
      forward must split the projection's output in three equal parts (``chunk(3)``) and
      reshape with the head count or ``-1`` heads.
    With ``embeddings``, every ``nn.Embedding`` becomes a VocabParallelEmbedding.

    Returns:
        qualified name -> one of :data:`STYLES` (layers not named stay replicated).
    """
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        def full(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name
        linears = _linears(parent)
        names = {n for n, _ in linears}
        qkv = [next((n for n in group if n in names), None) for group in _QKV]
        fused = next((n for n in sorted(names) if n.lower() in _FUSED), None)
        out = next((n for n in _OUT if n in names), None)
        if (all(qkv) or fused is not None) and out is not None:
            inputs = [n for n in qkv if n is not None] if all(qkv) else [fused]
            if _heads_of(parent) is None:  # splitting q/k/v needs whole heads per rank
                warnings.warn(f"tensor_parallel: {prefix or '<root>'} ({type(parent).__name__}) "
                              f"has q/k/v and output projections but no head count (an int "
                              f"attribute {', '.join(_HEADS)}), so they stay replicated; "
                              "pass plan= to split them", stacklevel=2)
            else:
                style = "column" if all(qkv) else "qkv"
                plan.update({full(n): style for n in inputs})
                plan[full(out)] = "row"
            linears = [(n, m) for n, m in linears if n not in {*inputs, out}]
        if _unknown_attention(parent):
            linears = []
        i = 0
        while i + 1 < len(linears):
            (a, first), (b, second) = linears[i], linears[i + 1]
            if first.out_features == second.in_features and _pairs(parent, prefix, a, b):
                plan[full(a)], plan[full(b)] = "column", "row"
                i += 2
            else:
                i += 1
        if embeddings:
            for n, child in parent.named_children():
                if type(child) is nn.Embedding:
                    plan[full(n)] = "vocab"
    return plan


def _pairs(parent: nn.Module, prefix: str, first: str, second: str) -> bool:
    between = elementwise_between(parent, first, second)
    if between is None:
        warnings.warn(f"tensor_parallel: the forward of {prefix or '<root>'} "
                      f"({type(parent).__name__}) cannot be traced to see what lies between "
                      f"{first} and {second}, so they stay replicated; pass plan= to split "
                      "them", stacklevel=4)
    return bool(between)


def _head_counts(parent: nn.Module) -> list[str]:
    """The names of ``parent``'s head-count attributes (ints, among :data:`_HEADS`)."""
    return [attr for attr in _HEADS if isinstance(getattr(parent, attr, None), int)
            and not isinstance(getattr(parent, attr), bool)]


def _heads_of(parent: nn.Module) -> str | None:
    """The name of ``parent``'s (first) head-count attribute, or None."""
    return next(iter(_head_counts(parent)), None)


def _unknown_attention(parent: nn.Module) -> bool:
    """A head count but no child named as a q/k/v projection: which of its layers are the
    attention's, whose split must divide the heads, cannot be told."""
    children = {name for name, _ in parent.named_children()}
    return _heads_of(parent) is not None and not children & _QKV_NAMES


def _attentions(plan: Mapping[str, str], modules: Mapping[str, nn.Module],
                parts: int) -> dict[str, nn.Module]:
    """The modules whose heads the plan's column layers split: those holding a column layer
    named as a q/k/v projection, or a ``"qkv"`` one.

    Raises:
        ValueError: a column layer with no row layer in its module to take its block of
            the outputs; a column layer in a module with a head count whose attention's
            projections cannot be told (:func:`_unknown_attention`).
    """
    rows = [name for name, style in plan.items() if style == "row"]
    attention: dict[str, nn.Module] = {}
    for name, style in plan.items():
        if style not in ("column", "qkv"):
            continue
        parent_name, _, child = name.rpartition(".")
        parent, inside = modules[parent_name], f"{parent_name}." if parent_name else ""
        where = f"{parent_name or '<root>'} ({type(parent).__name__})"
        if not any(row.startswith(inside) for row in rows):
            out = modules[name].out_features
            raise ValueError(f"plan for layer {name!r}: a {style} layer leaves each rank a "
                             f"block of its outputs ({out // parts} of {out} here), which only "
                             f"a row layer can take, and the plan has no \"row\" layer in "
                             f"{where}; plan the layer that reads its output \"row\" (or this "
                             "one \"replicate\")")
        if style == "qkv" or child in _QKV_NAMES:
            attention[parent_name] = parent
        elif _unknown_attention(parent):
            attr = _heads_of(parent)
            raise ValueError(
                f"plan for layer {name!r}: {where} has a head count ({attr} = "
                f"{getattr(parent, attr)}) but no layer named as a q/k/v projection (q, "
                f"q_proj, wq, query, ...), so tensor_parallel cannot tell whether splitting "
                f"{child} splits its heads (a head count left whole, or divided wrongly, "
                "computes another attention); plan a fused [q; k; v] projection \"qkv\", name "
                "the projections q/k/v, or leave this module's layers replicated")
    return attention


def _attention_heads(parent: nn.Module, name: str, parts: int, *, apply: bool) -> None:
    for attr in _head_counts(parent):
        heads = getattr(parent, attr)
        if heads % parts:
            raise ValueError(f"attention {name or '<root>'}: {attr} = {heads} must be "
                             f"divisible by the model group size {parts}")
        if apply:
            setattr(parent, attr, heads // parts)


def tensor_parallel(module: nn.Module, distribution: Distribution, *,
                    plan: Mapping[str, str] | None = None,
                    embeddings: bool = False) -> nn.Module:
    """Replace ``module``'s layers, in place, by their tensor-parallel form on the MODEL group.

    Every rank of a model group must hold the same model: its parameters and buffers are
    first broadcast from model-group rank 0, then each rank keeps its shard of each converted
    layer, so the network computes exactly what the original did. An attention module
    whose q/k/v (children named ``q``, ``q_proj``, ``wq``, ``query``, ...) become column
    parallel, or whose fused ``[q; k; v]`` projection is planned ``"qkv"``, gets its head
    counts (``num_heads``, ``n_heads``, ``num_key_value_heads``, ...) divided by the model
    degree: its forward must reshape with them (or with ``-1`` heads), and split a fused
    projection's output in three equal parts (each rank's ``[q_r; k_r; v_r]``). An
    ``nn.Dropout`` its forward calls between a column layer and its row layer becomes a
    :class:`~scaleout.pytorch.SplitRegionDropout`, which draws a mask of its own on each
    model rank (``split_regions.py``; ``F.dropout`` in a forward: run it under
    ``ModelParallelRNG(distribution).fork()``).

    Args:
        module: the plain model (changed in place and returned).
        distribution: the grid; layers are split across its MODEL group.
        plan: qualified layer name -> ``"column"``, ``"qkv"``, ``"row"``, ``"vocab"`` or
            ``"replicate"``; default :func:`plan_tensor_parallel`.
        embeddings: with the default plan, shard ``nn.Embedding`` tables by rows too.

    Returns:
        ``module``.

    Raises:
        ValueError: a planned layer is missing or not an nn.Linear/nn.Embedding, a style is
            unknown, a split size does not divide by the model group size (the message
            names the layer and the sizes), a planned layer's weight is tied to another
            module's, a column layer has no row layer in its module, a fused projection
            (``qkv``, ``c_attn``, ...) is planned ``"column"``, or a column layer's module
            has a head count but no layer named q/k/v, or a replicated parameter acts on
            the activations between a column and a row layer (nothing is converted then).
        TypeError: ``module`` or ``distribution`` of the wrong type.

    Example (2 ranks, grid 1 x 2):
        >>> net = tensor_parallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)),
        ...                       env.create_distribution(1, 2))
        >>> net[0].weight.shape   # rank 0: rows 0..15, rank 1: rows 16..31
        torch.Size([16, 8])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(distribution, Distribution):
        raise TypeError(f"distribution must be a scaleout.Distribution, got "
                        f"{type(distribution).__name__}")
    plan = dict(plan_tensor_parallel(module, embeddings=embeddings) if plan is None else plan)
    comm = distribution.communicator(GroupType.MODEL)
    if comm.size > 1:  # (already-placed tensors, shards or local tables, are left alone)
        refuse_meta(module, "tensor_parallel")
        broadcast_tensors(comm, [*(p for p in module.parameters() if placement_of(p) is None),
                                 *module.buffers()])
    modules = dict(module.named_modules())
    names: dict[int, list[str]] = {}  # a parameter's every name (a tied one has several)
    for qualified, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(qualified)
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan for layer {name!r}: style must be one of {STYLES}, got "
                             f"{style!r}")
        if style == "replicate":
            continue
        layer = modules.get(name)
        wanted = nn.Embedding if style == "vocab" else nn.Linear
        if type(layer) is not wanted:
            raise ValueError(f"plan for layer {name!r}: expected an {wanted.__name__}, got "
                             f"{'nothing' if layer is None else type(layer).__name__}")
        for kind, param in layer.named_parameters(recurse=False):
            tied = [n for n in names[id(param)] if n != f"{name}.{kind}"]
            if tied:
                raise ValueError(f"plan for layer {name!r}: its {kind} is also {tied[0]} (tied); "
                                 "a split layer gets weights of its own, which would untie them")
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        if style == "column" and child.lower() in _FUSED:
            raise ValueError(f"plan for layer {name!r}: a fused [q; k; v] projection planned "
                             "\"column\" would give each rank a contiguous block of rows "
                             "(rank 0 all of q and part of k); plan it \"qkv\" to split q, k "
                             "and v alike")
        if style in ("column", "qkv"):
            new: nn.Module = ColumnParallelLinear.from_linear(
                layer, distribution=distribution, name=name, blocks=3 if style == "qkv" else 1)
        elif style == "row":
            new = RowParallelLinear.from_linear(layer, distribution=distribution, name=name)
        else:
            new = VocabParallelEmbedding.from_embedding(layer, distribution=distribution,
                                                        name=name)
        replacements.append((parent, child, new))
    attention = _attentions(plan, modules, comm.size)
    for name, parent in attention.items():  # every check passes before anything changes
        _attention_heads(parent, name, comm.size, apply=False)
    shared = tensor_parallel_shared_parameters(module, plan) if comm.size > 1 else []
    if shared:  # (before stop 51 each rank trained them on its block's share, silently)
        raise ValueError(
            f"tensor_parallel: {', '.join(shared)} (replicated) would act on the activations "
            "split between a column and a row layer, so each rank's gradient would be its "
            "block's share only and the ranks' copies would part; move it out of the split "
            "region, or plan its module's layers \"replicate\"")
    dropouts = tensor_parallel_dropouts(module, plan) if comm.size > 1 else []
    for parent, child, new in replacements:
        setattr(parent, child, new)
    for name, parent in attention.items():
        _attention_heads(parent, name, comm.size, apply=True)
    fork_dropouts(module, dropouts, distribution)
    return module


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """The full, plain ``state_dict`` of a tensor-parallel model, on every rank.

    Sharded parameters are all-gathered over their model group (every rank of the group
    must call this); the keys are those of the original model when ``module`` is the model
    :func:`tensor_parallel` converted (pass DataParallel's ``.module``; call its
    ``synchronize()`` first).

    Modules with a ``full_state()`` method (an
    :class:`~scaleout.pytorch.EmbeddingCollection`) contribute every table they shard.

    Returns:
        name -> tensor (detached copies for gathered entries).
    """
    state = module.state_dict()
    for prefix, child in module.named_modules():
        gather = getattr(child, "full_state", None)
        if callable(gather):
            for key in [k for k in state if k.startswith(f"{prefix}.") or not prefix]:
                del state[key]
            state.update({f"{prefix}.{k}" if prefix else k: v for k, v in gather().items()})
    for name, param in module.named_parameters():
        mark = placement_of(param)
        if mark is None or mark.kind is not Kind.SHARDED or name not in state:
            continue
        assert mark.comm is not None
        block = param.detach().movedim(mark.dim, 0).contiguous()
        gathered = collectives.allgather(mark.comm, block).wait()  # the parts in rank order
        state[name] = mark.joined(gathered.movedim(0, mark.dim)).contiguous()
    return state


def load_full_state_dict(module: nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a full, plain ``state_dict`` (from :func:`full_state_dict` or the original model)
    into a tensor-parallel model: each rank takes its block of every sharded tensor, and
    modules with a ``load_full_state()`` method (an EmbeddingCollection) their tables.
    No communication.

    Args:
        module: the converted model (DataParallel's ``.module``).
        state: the full state dict. strict: as for ``nn.Module.load_state_dict``.

    Returns:
        What ``load_state_dict`` returns (missing and unexpected keys).

    Raises:
        ValueError: a sharded entry's shape is not the full tensor's.
    """
    local = dict(state)
    for prefix, child in module.named_modules():
        take = getattr(child, "load_full_state", None)
        if callable(take):
            head = f"{prefix}." if prefix else ""
            mine = take({k[len(head):]: v for k, v in state.items() if k.startswith(head)})
            for key in [k for k in local if k.startswith(head)]:
                del local[key]
            local.update({head + k: v for k, v in mine.items()})
    for name, param in module.named_parameters():
        mark = placement_of(param)
        if mark is None or mark.kind is not Kind.SHARDED or name not in local:
            continue
        assert mark.comm is not None
        full = local[name]
        size = param.shape[mark.dim]
        if full.shape[mark.dim] != size * mark.parts:
            raise ValueError(f"load_full_state_dict: {name} (layer {mark.layer}) needs the full "
                             f"tensor, {size * mark.parts} along dim {mark.dim}; got shape "
                             f"{tuple(full.shape)}")
        local[name] = mark.part_of(full, mark.comm.rank)
    return module.load_state_dict(local, strict=strict)
