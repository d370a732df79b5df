"""What every ``bench train`` set-up shares: the options it is built from, the :class:`Setup`
it returns, the optimizer every configuration uses, and scaleout's per-iteration figures."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scaleout.pytorch.tune_check import check_iterations
from scaleout.workloads import Workload

__all__ = ["AUTO_WARMUP", "AUTO_WARMUP_DEFAULT", "LEAD_IN", "LR", "MOMENTUM", "Setup",
           "SetupOptions", "nothing", "param_groups", "sgd", "statistics_of", "steps_per_round",
           "tune_windows"]

#: Timed iterations before ``--iters`` whose times are kept in the JSON but left out of the
#: figures: the first after the settle that ends the warm-up has nothing earlier to wait for
#: (:mod:`scaleout.bench.train_worker`).
LEAD_IN = 1


def steps_per_round(warmup: int, iters: int) -> int:
    """Training steps one round takes: the warm-up, the lead-in and the counted iterations."""
    return warmup + LEAD_IN + iters


#: The SGD every configuration trains with.
LR = 0.01
MOMENTUM = 0.9

#: The fewest warm-up iterations with ``compression="auto"``: one builds the plan, one is
#: measured, then the check (:mod:`scaleout.pytorch.tune_check`) runs the tuned plan, its
#: runner-up (when it has one) and the tuned plan again, each window one iteration to settle
#: and then one, two and one timed (``TuneConfig.verify`` = 2, the choice's split around the
#: runner-up's), and one runs the plan that check kept.
AUTO_WARMUP = 10
#: ``bench train``'s and ``scaleout tune``'s warm-up with ``auto`` when none is given: the
#: six iterations beyond :data:`AUTO_WARMUP` lengthen the windows that time the defaults (3
#: iterations instead of 1) and each trial of the check (4 instead of 2) (:func:`tune_windows`).
#: DLRM's iterations on this machine spread by +-20% (11-25 ms at 10 Gbit/s): with one and two,
#: the check restored the defaults in 2 of 4 runs where its choice ran 1.2x faster.
AUTO_WARMUP_DEFAULT = 16


def tune_windows(warmup: int) -> tuple[int, int]:
    """``(measure, verify)`` of the tuner in a warm-up of ``warmup`` iterations: the plan's
    build, the check (:func:`~scaleout.pytorch.tune_check.check_iterations` with a runner-up)
    and the kept plan take what ``verify`` needs; of every five iterations beyond
    :data:`AUTO_WARMUP` four go to the check (``verify`` + 2), the rest to ``measure``
    (10 -> (1, 2), 15 -> (2, 4), 16 -> (3, 4); fewer than 10 -> (1, 2))."""
    verify = 2 + 2 * (max(warmup - AUTO_WARMUP, 0) // 5)
    return max(warmup - 2 - check_iterations(verify, 2), 1), verify


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
        batch: samples per rank per iteration, when known (``hybrid``: its tables'
            ``max_batch``, so each batch's ids travel in one round).
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
    batch: int | None = None

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
        prefetch: called with the next iteration's inputs before every iteration (the
            batches cycle, and the last iteration of a round prefetches the first of the
            next, or one that the closing settle drains), and with the very first
            iteration's inputs before it (``hybrid``: starts the exchange of a batch's ids,
            which its forward then takes), or ``None``.
        parameters: the model's parameters whole, named as in the workload's model, on
            every rank (every rank calls it at once: ``hybrid`` gathers its tables), or
            ``None``: the model's own, its DDP or DataParallel wrapper taken off
            (:mod:`scaleout.bench.train_digest`).
        after_round: called once a round's timed iterations are settled, to bring
            ``details`` up to date (DDP: its buckets as rebuilt), or ``None``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    settle: Callable[[], None]
    reset: Callable[[], None]
    statistics: Callable[[], dict[str, float]] | None
    close: Callable[[], None]
    details: dict[str, Any]
    prefetch: Callable[[Any], None] | None = None
    parameters: Callable[[], dict[str, torch.Tensor]] | None = None
    after_round: Callable[[], None] | None = None


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


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def nothing() -> None:
    return None


def statistics_of(model: Any) -> tuple[Callable[[], dict[str, float]], Callable[[], None]]:
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
