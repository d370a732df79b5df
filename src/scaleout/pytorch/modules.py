"""Module discovery (which modules become Operations), their registration with a session,
and the broadcast of their tensors."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scaleout.compression import RowsCodec
from scaleout.core.collectives import Communicator
from scaleout.core import collectives
from scaleout.core.checks import SUPPORTED_DTYPES
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.placement import is_local, registration
from scaleout.pytorch.lookup_reads import LOOKUP_DENSE_ABOVE
from scaleout.session import Operation, ParameterSet, ParameterSetSpec, Session

__all__ = ["Layer", "find_layers", "agreed_order", "broadcast_tensors", "register_layers",
           "set_bucket_parameters", "USAGE"]


@dataclass(eq=False)
class Layer:
    """A module that owns trainable parameters, and its place in the session.

    Attributes:
        name: the module's qualified name (``""`` is the root).
        module: the module.
        params: its own trainable parameters (each becomes a ParameterSet).
        op / sets: the Operation and ParameterSets once the session is committed.
        early: for a tied parameter split in two shares (``scaleout.pytorch.tied``), its
            index in ``params`` -> the parameter set of its early share; its set in ``sets``
            then carries the lookup's share.
        update_requested: gradients are in flight and ``step()`` asked for the update.
        increments_pending: new values (distributed update) are in flight.
        carry: parameter index -> averaged gradient owed from a plan that was replaced (its
            codec's error-feedback residual; ``scaleout.pytorch.residual_carry``), added
            once to that parameter's next averaged gradient.
    """

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    op: Operation | None = None
    sets: list[ParameterSet] = field(default_factory=list)
    early: dict[int, ParameterSet] = field(default_factory=dict)
    update_requested: bool = False
    increments_pending: bool = False
    carry: dict[int, torch.Tensor] = field(default_factory=dict)

    def all_sets(self) -> list[ParameterSet]:
        """Its parameter sets and its parameters' early shares."""
        return [*self.sets, *self.early.values()]


def find_layers(module: nn.Module, data_ranks: int | None = None) -> list[Layer]:
    """Every module with trainable parameters of its own, in registration order.

    A parameter shared by several modules (tied weights) belongs to the first one; one
    marked local to this rank (``scaleout.pytorch.placement``) belongs to none, and so does
    one with no elements (``torch.empty(0)``): there is nothing to average, so it is left
    out of communication and its ``.grad`` stays as autograd leaves it. ``data_ranks``: the
    data group's size when the layers are DataParallel's (its embeddings are then checked:
    :func:`_refuse_embedding`); ``None``: discovery alone.

    Raises:
        TypeError: a trainable parameter is sparse or complex (not supported); with
            ``data_ranks``, an embedding trained with ``sparse=True``.
        ValueError: with ``data_ranks`` > 1, an embedding trained with ``max_norm`` or
            ``scale_grad_by_freq``.
    """
    seen: set[int] = set()
    layers = []
    for name, mod in module.named_modules():
        if data_ranks is not None:
            _refuse_embedding(name, mod, data_ranks)
        params = []
        for own, param in mod.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen or is_local(param):
                continue
            if param.numel() == 0:  # nothing to average (a ParameterSet needs >= 1 value)
                continue
            if param.is_sparse:
                raise TypeError(f"parameter of {name or 'the root module'} is sparse; scaleout "
                                "exchanges dense gradients (use sparse=False embeddings)")
            if param.is_complex():
                raise TypeError(f"parameter {name + '.' if name else ''}{own} is {param.dtype}: "
                                "scaleout exchanges real floating-point gradients (keep it as "
                                "a real tensor of pairs and use torch.view_as_complex in forward)")
            seen.add(id(param))
            params.append(param)
        if params:
            layers.append(Layer(name=name or "<root>", module=mod, params=params))
    return layers


def _refuse_embedding(name: str, mod: nn.Module, data_ranks: int) -> None:
    """Refuse a trained embedding whose data-parallel gradient would be wrong or fail.

    ``sparse=True``: the gradient is a sparse tensor (it failed in backward with torch's
    "copy_() between dense and sparse Tensors"). Across ``data_ranks`` > 1: ``max_norm``
    renormalises, in place, the rows this rank's batch reads only, so the ranks' tables
    drift apart (2.3 apart after 4 SGD steps, ``tests/test_embedding_tuner_hunt.py``), and
    ``scale_grad_by_freq`` divides by the counts in this rank's batch, not the whole batch's
    (0.15 off the single-process reference).
    """
    if not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or not mod.weight.requires_grad \
            or is_local(mod.weight):  # (an EmbeddingCollection's own tables: sparse, local)
        return
    where = f"{type(mod).__name__} {name or '<root>'}"
    if mod.sparse:
        raise TypeError(f"{where} has sparse=True: its gradient is a sparse tensor and "
                        "scaleout exchanges dense gradients (use sparse=False)")
    reasons = {"max_norm": "renormalises, in place, only the rows each rank's batch reads: "
                           "the replicas drift apart",
               "scale_grad_by_freq": "counts the ids of each rank's batch, not of the whole "
                                     "batch: the gradient is not the single-process one"}
    for option, why in reasons.items():
        if getattr(mod, option) and data_ranks > 1:
            raise ValueError(f"{where} has {option}={getattr(mod, option)!r}, which {why} "
                             f"({data_ranks} data-parallel ranks); renormalise or scale in the "
                             f"model instead, or freeze the table")


def refuse_meta(module: nn.Module, caller: str) -> None:
    """Raise ValueError naming the first parameter or buffer of ``module`` on the meta device:
    ``caller`` broadcasts the model from one rank when it is built, and a meta tensor has no
    values (the broadcast passed, and a model materialised afterwards with ``to_empty``
    failed later with torch's "Cannot copy out of meta tensor", naming no fix)."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_meta:
            raise ValueError(f"{caller}: {name} is on the meta device; it broadcasts the "
                             f"model from one rank when it is built, so materialise the model "
                             f"first (module.to_empty(device=...) and initialise it)")


def refuse_thawed(module: nn.Module, frozen: list[nn.Parameter]) -> None:
    """Raise when a parameter frozen when DataParallel was built (``frozen``: left out of
    its layers) requires grad now.

    Raises:
        ValueError: naming them (before, nothing exchanged their gradients: in overlap mode
            they never moved, in sync mode each rank stepped on its own, the ranks apart).
    """
    thawed = {id(p) for p in frozen if p.requires_grad}
    if thawed:
        names = [name for name, p in module.named_parameters() if id(p) in thawed]
        raise ValueError(f"parameters {names[:4]}{' ...' if len(names) > 4 else ''} were "
                         f"frozen (requires_grad=False) when DataParallel was built and "
                         f"require grad now: their gradients are not exchanged. Build "
                         f"DataParallel after unfreezing them (a frozen backbone that thaws: "
                         f"wrap the model again then), or keep them frozen")


def agreed_order(comm: Communicator, layers: list[Layer], ran: list[Layer],
                 device: torch.device) -> list[Layer]:
    """The layers in the order of the first forward, the same on every rank of ``comm``.

    ``ran``: the layers this rank's first forward ran, in order; the others follow. Every
    rank must register the same order (it decides the buckets), but a layer may run in one
    rank's first forward and not in another's: rank 0's order counts (one broadcast of
    layer indices, once).
    """
    seen = {id(layer) for layer in ran}
    mine = ran + [layer for layer in layers if id(layer) not in seen]
    index = {id(layer): i for i, layer in enumerate(layers)}
    order = torch.tensor([index[id(layer)] for layer in mine], dtype=torch.int64, device=device)
    collectives.bcast(comm, order, 0).wait()
    return [layers[i] for i in order.tolist()]


def broadcast_tensors(comm: Communicator, tensors: Iterable[torch.Tensor], root: int = 0) -> None:
    """Broadcast ``tensors`` from group rank ``root`` in place, one fused buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        # a dtype the collectives do not take (a bool mask, a complex RoPE table, int16
        # ids) travels as its bytes: a broadcast copies them (DataParallel refused such
        # models, even on one process)
        wire = flat if flat.dtype in SUPPORTED_DTYPES else flat.view(torch.uint8)
        collectives.bcast(comm, wire, root).wait()
        offset = 0
        with torch.no_grad():
            for tensor in group:
                tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


#: The operation whose one parameter set carries, per parameter, whether this rank used it.
USAGE = "<parameters used>"


def register_layers(session: Session, distribution: Distribution, layers: list[Layer],
                    names: dict[int, str], *, distributed_update: bool,
                    compression: Any, split: Collection[int] = (),
                    rows: Collection[int] = ()) -> ParameterSet | None:
    """Add one Operation per layer (in ``layers``' order) to ``session``, one ParameterSet per
    parameter, after the operation that carries who used what; return that one's set.

    The usage set is registered first, so it shares the bucket of the first layers'
    gradients (the last to be ready in backward): knowing who used what costs no collective
    of its own. ``names``: parameter id to qualified name. ``split``: ids of tied parameters
    sent in two shares (``scaleout.pytorch.tied``): their own set carries the lookup's share,
    row-sparse; an operation after the last layer (so first in backward order) carries the
    early share, exact, in ``layer.early``. ``rows``: ids of parameters read by embedding
    lookups alone (``scaleout.pytorch.lookup_reads``): sent row-sparse, exact.
    """
    params = [p for layer in layers for p in layer.params]
    usage = None
    if params:
        spec = ParameterSetSpec(count=len(params), dtype=params[0].dtype, name=USAGE,
                                device=params[0].device, model_split=False)
        usage = session.add_operation(USAGE, distribution, parameter_sets=[spec]).parameter_sets[0]
    model_comm = distribution.communicator(GroupType.MODEL)
    for layer in layers:
        specs = [ParameterSetSpec(count=count, dtype=p.dtype, name=names.get(id(p), ""),
                                  distributed_update=distributed_update,
                                  compression=(RowsCodec(dense_above=LOOKUP_DENSE_ABOVE)
                                               if id(p) in split or id(p) in rows
                                               else compression),
                                  shape=shape, device=p.device, model_split=parted)
                 for p in layer.params
                 for count, shape, parted in [registration(p, model_comm)]]
        layer.op = session.add_operation(layer.name, distribution, parameter_sets=specs)
        layer.sets = layer.op.parameter_sets
        layer.early = {}
    for layer in layers:
        for index, (p, ps) in enumerate(zip(layer.params, layer.sets)):
            if id(p) in split:
                name = f"{ps.name} (early share)"
                spec = ParameterSetSpec(count=ps.spec.count, dtype=p.dtype, name=name,
                                        shape=ps.spec.shape, device=p.device,
                                        model_split=ps.spec.model_split)
                op = session.add_operation(name, distribution, parameter_sets=[spec])
                layer.early[index] = op.parameter_sets[0]
    return usage


def set_bucket_parameters(session: Session, layers: list[Layer]) -> None:
    """Tell each bucket of the committed ``session`` which parameters its members are (its
    ``parameters()`` for comm hooks): ``layers``' sets and their early shares."""
    param_of = {id(ps): p for layer in layers for p, ps in zip(layer.params, layer.sets)}
    param_of.update({id(ps): layer.params[i] for layer in layers
                     for i, ps in layer.early.items()})
    for bucket in session.buckets:
        bucket.set_parameters([param_of[id(ps)] for ps in bucket.members if id(ps) in param_of])
