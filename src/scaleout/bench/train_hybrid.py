"""``bench train``'s ``hybrid`` set-up: DLRM's tables sharded across the ranks and updated in
backward, its dense MLPs data parallel, the next batch's ids and rows prefetched
(``hybrid-noprefetch``: not; ``hybrid-deferred``: prefetched, and the rows' gradients sent
back without blocking backward; ``hybrid-unfused``: the tables' sparse gradients stepped by
torch's SGD after backward; ``hybrid-one-round``: each batch's ids sent when prefetched,
in one exchange of their own, instead of with the rows' gradients of the batch before;
``hybrid-two-rounds``: its id counts, then its ids, as two exchanges), and its ceiling,
``hybrid-lockstep``.

``hybrid-lockstep`` is not a trainer. Every rank holds all the tables and trains its own copy
of the model on its own samples, with ``hybrid``'s code: the same lookups through an
:class:`EmbeddingCollection` (on a data group of one rank), the same update of the tables in
backward, the same dense SGD. The ranks meet once per iteration in a one-element allreduce,
as in ``lockstep``, and move nothing else. A rank of ``hybrid`` looks up as many rows (its
half of the tables for twice the samples) and computes the same dense layers, so no
synchronous hybrid run can be faster here. It differs from ``lockstep``, which runs the
data-parallel model's compute (dense table gradients, a step over whole tables)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaleout.bench.train_ceilings import LockstepSGD
from scaleout.bench.train_setup import (
    LR,
    MOMENTUM,
    Setup,
    SetupOptions,
    nothing,
    sgd,
    statistics_of,
)

__all__ = ["IDS", "Pair", "build_hybrid", "build_hybrid_lockstep", "whole_parameters"]


class Pair(torch.optim.Optimizer):
    """Steps a dense (data-parallel) optimizer and an optional table (sparse) one together,
    then calls ``after()`` (every rank, whether it holds tables or not)."""

    def __init__(self, dense: torch.optim.Optimizer, tables: torch.optim.Optimizer | None,
                 after: Callable[[], Any] | None = None) -> None:  # no param groups of its own
        self.dense, self.tables, self.after = dense, tables, after
        self.param_groups = dense.param_groups
        self.defaults: dict[str, Any] = {}
        self.state: Any = {}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.dense.step()
        if self.tables is not None:
            self.tables.step()
        if self.after is not None:
            self.after()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        if self.tables is not None:
            self.tables.zero_grad(set_to_none=set_to_none)


def _model(options: SetupOptions) -> nn.Module:
    """The workload's model, which must keep its tables in an ``embeddings`` list (DLRM)."""
    net = options.workload.build_model(options.seed)
    if not isinstance(getattr(net, "embeddings", None), nn.ModuleList):
        raise ValueError(f"hybrid: the workload {options.workload.name!r} has no embedding "
                         "tables to shard (use --workload dlrm)")
    return net


def _dense(net: nn.Module) -> list[nn.Parameter]:
    """The parameters outside the tables (the MLPs: data parallel, or local in the ceiling)."""
    return [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]


def _shard_tables(net: nn.Module, dist: Any, ranks: int, budget_bytes: int | None,
                  max_batch: int | None, ids_with_gradients: bool = False) -> Any:
    """Replace ``net.embeddings`` by an :class:`EmbeddingCollection` on ``dist``'s data group
    of ``ranks``, planned under ``budget_bytes`` of parameters per rank (each batch's ids in
    one round where ``max_batch`` is known, with the rows' gradients if
    ``ids_with_gradients``); returns the plan."""
    from scaleout.pytorch import EmbeddingCollection, TableSpec, plan_tables

    tables = net.embeddings
    specs = [TableSpec(rows=t.num_embeddings, dim=t.embedding_dim, name=str(i))
             for i, t in enumerate(tables)]
    dense_bytes = sum(p.numel() * p.element_size() for p in _dense(net))
    budget = None if budget_bytes is None else budget_bytes - dense_bytes
    if budget is not None and budget < 1:
        raise ValueError(f"hybrid: the memory budget of {budget_bytes} bytes leaves no "
                         f"room for tables beside the dense parameters' {dense_bytes} bytes")
    plan = plan_tables(specs, ranks, memory_budget=budget,
                       element_size=tables[0].weight.element_size())
    net.embeddings = EmbeddingCollection.from_embeddings(
        list(tables), dist, plan=plan, max_batch=max_batch,
        ids_with_gradients=ids_with_gradients)
    return plan


def whole_parameters(net: nn.Module) -> dict[str, torch.Tensor]:
    """DLRM's parameters with its sharded tables gathered whole on every rank (a collective
    of the data group: every rank calls it), named as in the unsharded model
    (``embeddings.<t>.weight``)."""
    dense = {n: p for n, p in net.named_parameters() if not n.startswith("embeddings.")}
    tables = {f"embeddings.{k}": v for k, v in net.embeddings.full_state().items()}
    return {**dense, **tables}


#: How a batch's ids reach the tables' holders, by ``build_hybrid``'s ``ids``.
IDS = {"with gradients": "counts and ids with the rows' gradients of the backward before",
       "one round": "counts and ids in one round", "two rounds": "counts, then ids"}


def build_hybrid(options: SetupOptions, prefetch: bool = True, defer: bool = False,
                 fused: bool = True, ids: str = "with gradients") -> Setup:
    import scaleout
    from scaleout.pytorch import DataParallel, DistributedOptimizer, FusedSGD

    if ids not in IDS:
        raise ValueError(f"build_hybrid: ids must be one of {sorted(IDS)}, got {ids!r}")

    net = _model(options)
    env = scaleout.init(timeout=options.timeout_s)
    dist = env.create_distribution()
    max_batch = None if ids == "two rounds" else options.batch
    plan = _shard_tables(net, dist, env.world_size, options.memory_budget, max_batch,
                         ids == "with gradients")
    dense = _dense(net)
    sparse = list(net.embeddings.parameters())
    model = DataParallel(net, dist, scheduler=options.scheduler())
    dense_opt = DistributedOptimizer(sgd(dense), model, mode=options.mode)
    table_opt = torch.optim.SGD(sparse, lr=LR) if sparse and not fused else None
    if fused:  # plain SGD on the rows, in the lookups' backward: no sparse .grad, no step
        net.embeddings.update_in_backward(FusedSGD(lr=LR))
    if defer:  # the rows' gradients land before a step (no table here: next lookup)
        net.embeddings.defer_backward(table_opt or dense_opt)

    def close() -> None:
        model.close()
        env.finalize()

    details = {"policy": options.policy, "mode": options.mode, "tables": plan.describe(),
               "ids": IDS[ids],
               "table_optimizer": "SGD (rows) in backward" if fused else "SGD (sparse rows)",
               "memory_budget": options.memory_budget,
               "prefetch": None if not prefetch else "the next batch's ids; its lookups once "
               "the tables are updated (" + ("at the end of backward)" if fused else
                                             "after their step)"),
               "backward": "the rows' gradients travel during the dense backward and land "
               "before the tables' step" if defer else "blocks on the rows' gradients"}
    statistics, reset = statistics_of(model)  # gradients and activation exchanges
    if not prefetch:
        return Setup(model=model, optimizer=Pair(dense_opt, table_opt), settle=model.synchronize,
                     reset=reset, statistics=statistics, close=close, details=details,
                     parameters=lambda: whole_parameters(net))
    # the next batch's rows leave as soon as the tables are updated (start_lookup): at the end
    # of backward when they are updated in it, else after their step
    if fused:
        net.embeddings.look_up_after_backward()
    after = None if fused else net.embeddings.start_lookup
    return Setup(model=model, optimizer=Pair(dense_opt, table_opt, after),
                 settle=model.synchronize, reset=reset,
                 statistics=statistics, close=close, details=details,
                 prefetch=lambda inputs: net.embeddings.prefetch(inputs.sparse),
                 parameters=lambda: whole_parameters(net))


def build_hybrid_lockstep(options: SetupOptions) -> Setup:
    """``hybrid``'s compute on every rank alone, meeting once per iteration (the module's
    docstring): a ceiling, not a trainer."""
    import scaleout
    from scaleout.pytorch import FusedSGD

    net = _model(options)
    env = scaleout.init(timeout=options.timeout_s)
    # a data group of one rank each: every rank looks its own samples up in all the tables
    dist = env.create_distribution(data_parts=1, model_parts=env.world_size)
    plan = _shard_tables(net, dist, 1, None, options.batch, True)
    dense = _dense(net)
    optimizer = LockstepSGD(dense, lr=LR, momentum=MOMENTUM)  # meets, then steps
    net.embeddings.update_in_backward(FusedSGD(lr=LR))
    net.embeddings.look_up_after_backward()
    details = {"exchange": "one 4-byte allreduce per iteration", "tables": plan.describe(),
               "table_optimizer": "SGD (rows) in backward",
               "prefetch": "the next batch's lookups at the end of backward, locally"}
    return Setup(model=net, optimizer=optimizer, settle=nothing, reset=nothing,
                 statistics=None, close=env.finalize, details=details,
                 prefetch=lambda inputs: net.embeddings.prefetch(inputs.sparse))
