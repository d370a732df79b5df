"""The training set-ups ``scaleout bench train`` compares: one function per configuration.

Every set-up builds the workload's model from the same seed and an SGD optimizer
(momentum 0.9; plain SGD on embedding tables, see :func:`param_groups`) and returns a :class:`Setup`: the module to call, the optimizer to step,
and what to do once warm-up ends, once timing ends, and at exit. The worker
(:mod:`scaleout.bench.train_worker`) runs the same loop over every set-up.

Configurations:

* ``single`` — one process, no communication: the ideal a data-parallel run is
  measured against.
* ``scaleout`` — :class:`~scaleout.pytorch.DataParallel` with a
  :class:`~scaleout.pytorch.DistributedOptimizer`.
* ``ddp`` — torch ``DistributedDataParallel`` with its default buckets (25 MB, first 1 MB).
* ``ddp-fp16`` — DDP with the ``fp16_compress_hook`` communication hook.
* ``ddp-powersgd`` — DDP with ``powerSGD_hook`` (rank :data:`POWERSGD_RANK`, compression
  from iteration :data:`POWERSGD_START`, error feedback and warm start on: torch's defaults).
* ``zero`` — DDP with torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded).
* ``ddp-tuned`` / ``ddp-tuned:MB`` — DDP as a careful user tunes it:
  ``gradient_as_bucket_view=True``, ``static_graph=True`` and ``bucket_cap_mb`` MB
  (default :data:`TUNED_BUCKET_MB`; sweep it with several ``ddp-tuned:MB`` peers in one run).
* ``lockstep``, ``lockstep-traffic`` — the machine's ceilings, not trainers
  (:mod:`scaleout.bench.train_ceilings`).
* ``hybrid`` — DLRM only: the embedding tables sharded across the ranks
  (:class:`~scaleout.pytorch.EmbeddingCollection`, planned under the memory budget: whole
  tables, row-wise for one no rank can hold; sparse SGD row updates), the dense MLPs data
  parallel through DataParallel; each iteration prefetches the next batch's ids
  (:meth:`~scaleout.pytorch.EmbeddingCollection.prefetch`) and, once the tables are updated,
  starts sending its rows (:meth:`~scaleout.pytorch.EmbeddingCollection.start_lookup`).
* ``hybrid-noprefetch`` — ``hybrid`` with neither: each forward exchanges its ids and rows
  when it runs (what prefetching gains, in one interleaved run).

Every set-up reports its parameter bytes per rank (``details["param_bytes"]``) and, with a
memory budget, whether they fit it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from scaleout.bench.train_ceilings import CEILINGS, build_lockstep
from scaleout.workloads import Workload

__all__ = ["AUTO", "PEERS", "CONFIGURATIONS", "POWERSGD_RANK", "POWERSGD_START", "TUNED_BUCKET_MB",
           "SetupOptions", "Setup", "build_setup", "is_configuration", "param_groups"]

#: Peers a user may name with ``--vs``.
PEERS = ("ddp", "ddp-tuned", "ddp-fp16", "ddp-powersgd", "zero", "hybrid", "hybrid-noprefetch",
         *CEILINGS)
#: Every configuration the worker can run.
CONFIGURATIONS = ("single", "scaleout", *PEERS)
#: PowerSGD's ``matrix_approximation_rank`` for ``ddp-powersgd``.
POWERSGD_RANK = 2
#: PowerSGD's ``start_powerSGD_iter``: plain allreduce before it. torch requires > 1 with
#: error feedback or warm start (both on by default), so 2 is the earliest.
POWERSGD_START = 2

#: ``compression`` values of scaleout tuning itself, and whether they allow lossy codecs
#: (``bench train --compression auto``; ``auto-exact``: scheduling only).
AUTO: Mapping[str, bool] = MappingProxyType({"auto": True, "auto-exact": False})

#: ``ddp-tuned``'s bucket size when none is named (torch's default; ``ddp-tuned:MB`` sweeps).
TUNED_BUCKET_MB = 25

LR = 0.01
MOMENTUM = 0.9


@dataclass(frozen=True, kw_only=True)
class SetupOptions:
    """What a set-up needs besides the configuration name.

    Attributes:
        workload: the model, data and loss.
        seed: model seed (the same on every rank and in every configuration).
        policy: scaleout's scheduling policy (``"priority"``, ``"fifo"`` or ``"default"``).
        mode: scaleout's DistributedOptimizer mode (``"overlap"`` or ``"sync"``).
        compression: scaleout's codec spec, ``None`` for exact gradients, or ``"auto"``:
            ``DataParallel(tune=...)`` chooses scheduling and codecs during the warm-up
            (``"auto-exact"``: scheduling only).
        timeout_s: rendezvous and collective timeout in seconds.
        device: where the model trains, ``"cpu"`` or ``"cuda"`` (this rank's GPU).
        memory_budget: bytes of parameters one rank may hold (``hybrid`` plans its tables
            under it); ``None``: unlimited.
        warmup: untimed iterations: ``"auto"`` measures all but the first and the last and
            tunes before the last (which then runs the tuned plan).
    """

    workload: Workload
    seed: int = 0
    policy: str = "default"
    mode: str = "overlap"
    compression: str | None = None
    timeout_s: float = 300.0
    memory_budget: int | None = None
    device: str = "cpu"
    warmup: int = 4

    def scheduler(self) -> Any:
        """scaleout's SchedulerConfig for ``policy`` (``"default"``: left to scaleout)."""
        import scaleout

        return scaleout.SchedulerConfig(policy=None if self.policy == "default" else self.policy)

    def torch_device(self) -> torch.device:
        """The device: the CPU, or ``cuda:LOCAL_RANK % GPUs``."""
        if self.device == "cpu":
            return torch.device("cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))

    def build_model(self) -> nn.Module:
        """The workload's model from the seed, on the device."""
        return self.workload.build_model(self.seed).to(self.torch_device())


@dataclass(frozen=True, kw_only=True)
class Setup:
    """A model ready to train, and its life-cycle hooks.

    Attributes:
        model: call as ``model(inputs)``.
        optimizer: ``step()`` then ``zero_grad()`` after each backward.
        settle: finish pending communication (before and after the timed loop).
        reset: forget what was recorded so far (after warm-up).
        statistics: scaleout's per-iteration figures, or ``None`` for peers.
        close: release threads and process groups.
        details: facts about the set-up for the report (hook options, bucket sizes).
        prefetch: called with the next iteration's inputs before each iteration but the
            last, and with the first iteration's inputs before it (``hybrid``: starts the
            exchange of a batch's ids, which its forward then takes), or ``None``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    settle: Callable[[], None]
    reset: Callable[[], None]
    statistics: Callable[[], dict[str, float]] | None
    close: Callable[[], None]
    details: dict[str, Any]
    prefetch: Callable[[Any], None] | None = None


def param_groups(net: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups, the same in every configuration: SGD with momentum
    on the dense parameters, plain SGD (no momentum) on the embedding tables (a module's
    ``embeddings`` list, as in DLRM).

    Plain SGD on a table's dense gradient moves exactly the rows a batch touched, which is
    what ``hybrid``'s sparse row update computes, so every configuration trains the same
    model and only the communication differs (momentum would keep moving untouched rows in
    the dense configurations and make them a different optimizer)."""
    tables = getattr(net, "embeddings", None)
    table_ids = {id(p) for p in tables.parameters()} if isinstance(tables, nn.Module) else set()
    groups: list[dict[str, Any]] = [
        {"params": [p for p in net.parameters() if id(p) not in table_ids]}]
    if table_ids:
        groups.append({"params": [p for p in net.parameters() if id(p) in table_ids],
                       "momentum": 0.0})
    return groups


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _nothing() -> None:
    return None


def _single(options: SetupOptions) -> Setup:
    model = options.build_model()
    return Setup(model=model, optimizer=_sgd(param_groups(model)), settle=_nothing,
                 reset=_nothing, statistics=None, close=_nothing, details={})


def _scaleout(options: SetupOptions) -> Setup:
    import scaleout
    from scaleout.pytorch import DataParallel, DistributedOptimizer
    from scaleout.pytorch.tuning import TuneConfig

    env = scaleout.init(timeout=options.timeout_s)
    net = options.build_model()
    auto = options.compression in AUTO
    model = DataParallel(net, env.create_distribution(),
                         scheduler=options.scheduler(),
                         compression=None if auto else options.compression,
                         tune=TuneConfig(allow_lossy=AUTO[options.compression], skip=1,
                                         measure=max(options.warmup - 2, 1)) if auto else None)
    optimizer = DistributedOptimizer(_sgd(param_groups(net)), model, mode=options.mode)
    statistics, reset = _statistics_of(model)

    def settle() -> None:  # "auto" tunes at the latest when the warm-up ends
        if auto:
            model.tune_now()
        model.synchronize()

    def close() -> None:
        model.close()
        env.finalize()

    details = {"policy": options.policy, "mode": options.mode,
               "compression": options.compression, "backend": env.backend}
    return Setup(model=model, optimizer=optimizer, settle=settle, reset=reset,
                 statistics=statistics, close=close, details=details)


def _statistics_of(model: Any) -> tuple[Callable[[], dict[str, float]], Callable[[], None]]:
    """A DataParallel model's per-iteration figures (rank 0's Statistics), and their reset."""

    def statistics() -> dict[str, float]:
        stats = model.statistics
        total = stats.total()
        n = max(stats.iterations, 1)
        return {"iterations": stats.iterations, "exposed_ms": total.exposed_s / n * 1e3,
                "comm_ms": total.comm_s / n * 1e3, "compute_ms": total.compute_s / n * 1e3,
                "bytes": total.bytes / n, "raw_bytes": total.raw_bytes / n}

    def reset() -> None:
        if model.session is not None:
            model.statistics.reset()

    return statistics, reset


def _ddp(options: SetupOptions, hook: str | None = None, zero: bool = False,
         tuned_mb: int | None = None) -> Setup:
    from torch.nn.parallel import DistributedDataParallel

    device = options.torch_device()
    backend = _backend(device)
    tdist.init_process_group(backend, init_method="env://",
                             timeout=timedelta(seconds=options.timeout_s))
    device_ids = [device.index] if device.type == "cuda" else None
    if tuned_mb is None:
        model = DistributedDataParallel(options.build_model(), device_ids=device_ids)
    else:
        model = DistributedDataParallel(options.build_model(), device_ids=device_ids,
                                        bucket_cap_mb=tuned_mb, gradient_as_bucket_view=True,
                                        static_graph=True)
    details: dict[str, Any] = {"bucket_cap_mb": tuned_mb or 25, "hook": hook, "backend": backend,
                               "gradient_as_bucket_view": tuned_mb is not None,
                               "static_graph": tuned_mb is not None}
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=POWERSGD_START)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        details.update(matrix_approximation_rank=POWERSGD_RANK,
                       start_powerSGD_iter=POWERSGD_START, use_error_feedback=True,
                       warm_start=True)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: torch.optim.Optimizer = ZeroRedundancyOptimizer(
            param_groups(model.module), optimizer_class=torch.optim.SGD, lr=LR,
            momentum=MOMENTUM)
        details["optimizer"] = "ZeroRedundancyOptimizer(SGD)"
    else:
        optimizer = _sgd(param_groups(model.module))
    return Setup(model=model, optimizer=optimizer, settle=_nothing, reset=_nothing,
                 statistics=None, close=tdist.destroy_process_group, details=details)


def _backend(device: torch.device) -> str:
    """The backend scaleout would choose here (so DDP and scaleout compare on the same one)."""
    from scaleout.core.env import choose_backend

    if device.type == "cpu":
        return "gloo"
    return choose_backend(local_rank=int(os.environ.get("LOCAL_RANK", "0")))[0]


def _lockstep(options: SetupOptions, traffic: bool) -> Setup:
    model = options.build_model()
    optimizer = build_lockstep(param_groups(model), traffic=traffic,
                               timeout_s=options.timeout_s, lr=LR, momentum=MOMENTUM)

    def close() -> None:
        optimizer.finish()
        tdist.destroy_process_group()

    exchange = "one 4-byte allreduce per iteration" + (
        " and one allreduce of the parameters' size in flight" if traffic else "")
    return Setup(model=model, optimizer=optimizer, settle=optimizer.finish, reset=_nothing,
                 statistics=None, close=close, details={"exchange": exchange})


class _Pair(torch.optim.Optimizer):
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


def _hybrid(options: SetupOptions, prefetch: bool = True) -> Setup:
    import scaleout
    from scaleout.pytorch import (DataParallel, DistributedOptimizer, EmbeddingCollection,
                                  TableSpec, plan_tables)

    net = options.workload.build_model(options.seed)
    tables = getattr(net, "embeddings", None)
    if not isinstance(tables, nn.ModuleList):
        raise ValueError(f"hybrid: the workload {options.workload.name!r} has no embedding "
                         "tables to shard (use --workload dlrm)")
    env = scaleout.init(timeout=options.timeout_s)
    dist = env.create_distribution()
    specs = [TableSpec(rows=t.num_embeddings, dim=t.embedding_dim, name=str(i))
             for i, t in enumerate(tables)]
    dense_bytes = sum(p.numel() * p.element_size() for n, p in net.named_parameters()
                      if not n.startswith("embeddings."))
    budget = None if options.memory_budget is None else options.memory_budget - dense_bytes
    if budget is not None and budget < 1:
        raise ValueError(f"hybrid: the memory budget of {options.memory_budget} bytes leaves no "
                         f"room for tables beside the dense parameters' {dense_bytes} bytes")
    plan = plan_tables(specs, env.world_size, memory_budget=budget,
                       element_size=tables[0].weight.element_size())
    net.embeddings = EmbeddingCollection.from_embeddings(list(tables), dist, plan=plan)
    dense = [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]
    sparse = list(net.embeddings.parameters())
    model = DataParallel(net, dist, scheduler=options.scheduler())
    dense_opt = DistributedOptimizer(_sgd(dense), model, mode=options.mode)
    table_opt = torch.optim.SGD(sparse, lr=LR) if sparse else None

    def close() -> None:
        model.close()
        env.finalize()

    details = {"policy": options.policy, "mode": options.mode, "tables": plan.describe(),
               "table_optimizer": "SGD (sparse rows)", "memory_budget": options.memory_budget,
               "prefetch": "the next batch's ids; its lookups once the tables are updated"
               if prefetch else None}
    statistics, reset = _statistics_of(model)  # gradients and activation exchanges
    if not prefetch:
        return Setup(model=model, optimizer=_Pair(dense_opt, table_opt), settle=model.synchronize,
                     reset=reset, statistics=statistics, close=close, details=details)
    # the next batch's rows leave as soon as the tables are updated (start_lookup)
    return Setup(model=model, optimizer=_Pair(dense_opt, table_opt, net.embeddings.start_lookup),
                 settle=model.synchronize, reset=reset,
                 statistics=statistics, close=close, details=details,
                 prefetch=lambda inputs: net.embeddings.prefetch(inputs.sparse))


_BUILDERS: dict[str, Callable[[SetupOptions], Setup]] = {
    "single": _single,
    "scaleout": _scaleout,
    "ddp": _ddp,
    "ddp-tuned": lambda o: _ddp(o, tuned_mb=TUNED_BUCKET_MB),
    "ddp-fp16": lambda o: _ddp(o, hook="fp16"),
    "ddp-powersgd": lambda o: _ddp(o, hook="powersgd"),
    "zero": lambda o: _ddp(o, zero=True),
    "hybrid": _hybrid,
    "hybrid-noprefetch": lambda o: _hybrid(o, prefetch=False),
    "lockstep": lambda o: _lockstep(o, traffic=False),
    "lockstep-traffic": lambda o: _lockstep(o, traffic=True),
}


def _tuned_mb(name: str) -> int | None:
    """``MB`` of a ``ddp-tuned:MB`` name (an int >= 1), else ``None``."""
    prefix = "ddp-tuned:"
    if not name.startswith(prefix) or not name[len(prefix):].isdigit():
        return None
    mb = int(name[len(prefix):])
    return mb if mb >= 1 else None


def is_configuration(name: str) -> bool:
    """Whether the worker can run ``name`` (one of :data:`CONFIGURATIONS` or ``ddp-tuned:MB``)."""
    return name in _BUILDERS or _tuned_mb(name) is not None


def build_setup(name: str, options: SetupOptions) -> Setup:
    """Build configuration ``name`` in this process (joins the job for all but ``single``).

    Args:
        name: one of :data:`CONFIGURATIONS`, or ``ddp-tuned:MB``.
        options: the shared options.

    Returns:
        The :class:`Setup`.

    Raises:
        ValueError: an unknown configuration name.
    """
    mb = _tuned_mb(name)
    if mb is not None:
        return _with_budget(_ddp(options, tuned_mb=mb), options)
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown configuration {name!r}; choose from "
                         f"{', '.join(CONFIGURATIONS)} or ddp-tuned:MB") from None
    return _with_budget(builder(options), options)


def _with_budget(setup: Setup, options: SetupOptions) -> Setup:
    """Record the parameter bytes this rank holds, and whether they fit the memory budget."""
    held = sum(p.numel() * p.element_size() for p in setup.model.parameters())
    setup.details["param_bytes"] = held
    if options.memory_budget is not None:
        setup.details["fits_memory_budget"] = held <= options.memory_budget
    return setup
