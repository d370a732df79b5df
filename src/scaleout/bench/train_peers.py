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
* ``scaleout-sharded`` — the same with ``distributed_update=True`` (MLSL's distributed
  update: gradients reduce-scattered, each rank updates its slice, the increments
  all-gathered; exact gradients whatever ``--compression`` says): the peer of ``zero``.
* ``ddp`` — torch ``DistributedDataParallel`` with its default buckets (25 MiB, first 1 MiB).
* ``ddp-fp16`` — DDP with the ``fp16_compress_hook`` communication hook.
* ``ddp-powersgd`` — DDP with ``powerSGD_hook`` (rank :data:`POWERSGD_RANK`, compression
  from iteration :data:`POWERSGD_START`, error feedback and warm start on: torch's defaults;
  over gloo one bucket at a time, :mod:`scaleout.bench.ddp_hooks`).
* ``zero`` — DDP with torch's ``ZeroRedundancyOptimizer`` (optimizer state sharded).
* ``ddp-tuned`` / ``ddp-tuned:MB`` — DDP as a careful user tunes it:
  ``gradient_as_bucket_view=True``, ``static_graph=True``, and torch's default buckets
  (``bucket_cap_mb=None``: 25 MiB, the first 1 MiB) or ``bucket_cap_mb=MB`` (which in torch
  2.13 also makes the first bucket MB; sweep it with several ``ddp-tuned:MB`` peers in one
  run).

Every DDP set-up records, after each round, the buckets as DDP rebuilt them after its first
iterations (``details["buckets_mib"]``, in the order they are reduced; ``buckets_rebuilt``
false while they are still the ones built at construction).
* ``lockstep``, ``lockstep-traffic`` — the machine's ceilings, not trainers
  (:mod:`scaleout.bench.train_ceilings`).
* ``hybrid`` — DLRM only: the embedding tables sharded across the ranks
  (:class:`~scaleout.pytorch.EmbeddingCollection`, planned under the memory budget: whole
  tables, row-wise for one no rank can hold; SGD row updates fused into the lookups'
  backward, :meth:`~scaleout.pytorch.EmbeddingCollection.update_in_backward`), the dense MLPs data
  parallel through DataParallel; each iteration prefetches the next batch's ids
  (:meth:`~scaleout.pytorch.EmbeddingCollection.prefetch`) and, once the tables are updated
  (at the end of backward), starts sending its rows
  (:meth:`~scaleout.pytorch.EmbeddingCollection.look_up_after_backward`).
* ``hybrid-deferred`` — ``hybrid`` whose backward sends the rows' gradients back without
  waiting for them (:meth:`~scaleout.pytorch.EmbeddingCollection.defer_backward`: they land
  before the tables' step; what deferring them gains, in one interleaved run).
* ``hybrid-noprefetch`` — ``hybrid`` with neither: each forward exchanges its ids and rows
  when it runs (what prefetching gains, in one interleaved run).
* ``hybrid-unfused`` — ``hybrid`` whose tables get sparse gradients, stepped by torch's SGD
  after backward, the next batch's rows sent after that step (what fusing the update gains).

Every set-up reports its parameter bytes per rank (``details["param_bytes"]``) and, with a
memory budget, whether they fit it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.bench.ddp_hooks import one_bucket_at_a_time
from scaleout.bench.train_ceilings import CEILINGS, build_lockstep
from scaleout.bench.train_hybrid import build_hybrid, build_hybrid_lockstep
from scaleout.bench.train_setup import (LR, MOMENTUM, Setup, SetupOptions, nothing,
                                       param_groups, sgd, statistics_of, tune_windows)

__all__ = ["AUTO", "PEERS", "CONFIGURATIONS", "POWERSGD_RANK", "POWERSGD_START", "TUNED_BUCKET_MB",
           "SetupOptions", "Setup", "build_setup", "ddp_buckets", "is_configuration",
           "param_groups"]

#: Peers a user may name with ``--vs``.
PEERS = ("ddp", "ddp-tuned", "ddp-fp16", "ddp-powersgd", "zero", "scaleout-sharded", "hybrid",
         "hybrid-deferred", "hybrid-noprefetch", "hybrid-unfused", "hybrid-one-round",
         "hybrid-two-rounds", *CEILINGS,
         "hybrid-lockstep")
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

#: ``ddp-tuned``'s bucket size when none is named: ``None``, torch's default layout (25 MiB,
#: the first bucket 1 MiB); naming 25 would make the first bucket 25 MiB too.
TUNED_BUCKET_MB = None

def _single(options: SetupOptions) -> Setup:
    model = options.build_model()
    return Setup(model=model, optimizer=sgd(param_groups(model)), settle=nothing,
                 reset=nothing, statistics=None, close=nothing, details={})


def _scaleout(options: SetupOptions, sharded: bool = False) -> Setup:
    import scaleout
    from scaleout.pytorch import DataParallel, DistributedOptimizer
    from scaleout.pytorch.tuning import TuneConfig

    env = scaleout.init(timeout=options.timeout_s)
    net = options.build_model()
    compression = None if sharded else options.compression
    auto = compression in AUTO
    measure, verify = tune_windows(options.warmup)
    model = DataParallel(net, env.create_distribution(),
                         scheduler=options.scheduler(),
                         compression=None if auto else compression,
                         tune=TuneConfig(allow_lossy=AUTO[compression], skip=1,
                                         measure=measure, verify=verify)
                         if auto else None, distributed_update=sharded)
    optimizer = DistributedOptimizer(sgd(param_groups(net)), model, mode=options.mode)
    statistics, reset = statistics_of(model)

    def settle() -> None:  # "auto" tunes at the latest when the warm-up ends
        if auto:
            model.tune_now()
        model.synchronize()
        if model.session is not None:  # the policy an open one resolved to (or the tuner's)
            details["policy_in_use"] = "+".join(dict.fromkeys(model.session.policies))

    def close() -> None:
        model.close()
        env.finalize()

    details = {"policy": options.policy, "mode": options.mode, "compression": compression,
               "distributed_update": sharded, "backend": env.backend}
    return Setup(model=model, optimizer=optimizer, settle=settle, reset=reset,
                 statistics=statistics, close=close, details=details)


def _ddp(options: SetupOptions, hook: str | None = None, zero: bool = False,
         tuned: bool = False, tuned_mb: int | None = None) -> Setup:
    from torch.nn.parallel import DistributedDataParallel

    device = options.torch_device()
    backend = _backend(device)
    tdist.init_process_group(backend, init_method="env://",
                             timeout=timedelta(seconds=options.timeout_s))
    device_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(options.build_model(), device_ids=device_ids,
                                    bucket_cap_mb=tuned_mb, gradient_as_bucket_view=tuned,
                                    static_graph=tuned)
    details: dict[str, Any] = {"bucket_cap_mb": tuned_mb, "hook": hook, "backend": backend,
                               "gradient_as_bucket_view": tuned, "static_graph": tuned}
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=POWERSGD_START)
        # on gloo one bucket at a time: torch's hook, issuing rounds from gloo's callbacks,
        # mismatches collectives between ranks otherwise (scaleout.bench.ddp_hooks)
        safe = backend != "gloo"
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook if safe
                                 else one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
        details["one_bucket_at_a_time"] = not safe
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
        optimizer = sgd(param_groups(model.module))
    return Setup(model=model, optimizer=optimizer, settle=nothing, reset=nothing,
                 statistics=None, close=tdist.destroy_process_group, details=details,
                 after_round=lambda: details.update(ddp_buckets(model)))


def ddp_buckets(model: Any) -> dict[str, Any]:
    """DDP's buckets as it reduces them: ``buckets_mib`` (in reduction order, after DDP's
    rebuild once it has seen an iteration; with ``static_graph`` after its second) and
    ``buckets_rebuilt``, from DDP's logging data."""
    try:  # (a private torch API: without it, the sizes are unknown, the run goes on)
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return {"buckets_mib": None, "buckets_rebuilt": None}
    rebuilt = data.get("rebuilt_bucket_sizes")
    sizes = rebuilt if rebuilt else data.get("bucket_sizes", "")
    return {"buckets_mib": [round(int(b) / 2**20, 2) for b in str(sizes).split(",") if b.strip()],
            "buckets_rebuilt": bool(rebuilt)}


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
    return Setup(model=model, optimizer=optimizer, settle=optimizer.finish, reset=nothing,
                 statistics=None, close=close, details={"exchange": exchange})


_BUILDERS: dict[str, Callable[[SetupOptions], Setup]] = {
    "single": _single,
    "scaleout": _scaleout,
    "scaleout-sharded": lambda o: _scaleout(o, sharded=True),
    "ddp": _ddp,
    "ddp-tuned": lambda o: _ddp(o, tuned=True, tuned_mb=TUNED_BUCKET_MB),
    "ddp-fp16": lambda o: _ddp(o, hook="fp16"),
    "ddp-powersgd": lambda o: _ddp(o, hook="powersgd"),
    "zero": lambda o: _ddp(o, zero=True),
    "hybrid": build_hybrid,
    "hybrid-deferred": lambda o: build_hybrid(o, defer=True),
    "hybrid-noprefetch": lambda o: build_hybrid(o, prefetch=False),
    "hybrid-unfused": lambda o: build_hybrid(o, fused=False),
    "hybrid-one-round": lambda o: build_hybrid(o, ids="one round"),
    "hybrid-two-rounds": lambda o: build_hybrid(o, ids="two rounds"),
    "lockstep": lambda o: _lockstep(o, traffic=False),
    "lockstep-traffic": lambda o: _lockstep(o, traffic=True),
    "hybrid-lockstep": build_hybrid_lockstep,
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
        return _with_budget(_ddp(options, tuned=True, tuned_mb=mb), options)
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
