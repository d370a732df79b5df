"""DDP training scripts' idioms the first hunt (``test_ddp_idioms_hunt.py``) did not reach, on
DataParallel at 2 and 3 ranks; overlap mode, sync mode and the sharded update, against a
float64 single process over every rank's batch.

- ``DistributedSampler(shuffle=True, drop_last=False)`` with ``set_epoch(e)`` and a
  ``DataLoader`` (``num_workers`` 0 and 2) over a dataset the ranks do not divide: the
  sampler pads every rank to the same number of samples, so every rank runs as many steps
  (uneven steps come from splitting a dataset by hand: ``test_uneven_steps.py``).
- learning-rate schedulers stepped per iteration (OneCycleLR, which cycles the momentum
  too, LambdaLR warm-up, CosineAnnealingLR) and per epoch (StepLR, ReduceLROnPlateau fed
  a rank-averaged validation loss), attached to the DistributedOptimizer or the wrapped
  optimizer: each update, landing later in overlap mode, uses its own step's options.
- rank 0 alone evaluating (``eval()`` + ``no_grad()``) before the first training step,
  once and twice.
- ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward and loss.
- ``model.train(False)`` / ``requires_grad_(False)`` on the whole model for an evaluation
  phase in the middle of training, then back.

Found wrong (fixed): with the sharded update and a scheduler attached to the wrapped
optimizer, ``DistributedOptimizer.param_groups`` showed the last step's options until the
next ``step()`` (the weights were right): an lr logged from them was a step behind, 0.39 off
under OneCycleLR. Everything else here held up exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer

#: (mode, distributed_update)
MODES = [("overlap", False), ("sync", False), ("overlap", True)]
SAMPLES, BATCH, EPOCHS = 13, 2, 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, 5, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (SAMPLES,), generator=g))


def validation() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def loader(world: int, rank: int, epoch: int, workers: int) -> DataLoader:
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=3,
                                 drop_last=False)
    sampler.set_epoch(epoch)
    return DataLoader(dataset(), batch_size=BATCH, sampler=sampler, num_workers=workers)


def scheduler(name: str, opt: torch.optim.Optimizer, steps: int) -> Any:
    if name == "OneCycleLR":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=steps)
    if name == "LambdaLR":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    if name == "CosineAnnealingLR":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    if name == "StepLR":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
    if name == "ReduceLROnPlateau":  # (every epoch's loss "worse": the lr drops each epoch)
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                          threshold=10.0)
    assert name == "none", name
    return None


PER_EPOCH = ("StepLR", "ReduceLROnPlateau")


def reference(world: int, sched: str) -> tuple[nn.Module, list[float]]:
    """Every rank's batch in one process; the model and the lr of every step."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    per_epoch = len(loader(world, 0, 0, 0))
    lrs = run_loop(net, opt, scheduler(sched, opt, EPOCHS * per_epoch), sched, lambda e: list(
        zip(*(loader(world, r, e, 0) for r in range(world)))), world, lambda v: v)
    return net, lrs


def run_loop(net: nn.Module, opt: torch.optim.Optimizer, sched: Any, name: str,
             epochs: Callable[[int], Any], world: int,
             average: Callable[[float], float]) -> list[float]:
    """The training loop (a step is a tuple of batches: one per rank in the reference);
    the lr each step ran with."""
    lrs = []
    for epoch in range(EPOCHS):
        for batches in epochs(epoch):
            lrs.append(opt.param_groups[0]["lr"])
            for x, y in batches:
                (F.cross_entropy(net(x), y) / len(batches)).backward()
            opt.step()
            opt.zero_grad()
            if sched is not None and name not in PER_EPOCH:
                sched.step()
        if name == "ReduceLROnPlateau":
            net.eval()
            with torch.no_grad():
                sched.step(average(F.cross_entropy(net(validation()[0]), validation()[1]).item()))
            net.train()
        elif sched is not None and name in PER_EPOCH:
            sched.step()
    return lrs


def body_train(sched: str, attach: str, workers: int) -> dict[str, float]:
    env = scaleout.init(timeout=20)
    ref, ref_lrs = reference(env.world_size, sched)
    worst: dict[str, float] = {}
    for mode, sharded in MODES:
        net = make_net()
        model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
        inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        opt = DistributedOptimizer(inner, model, mode=mode)
        lengths = [None] * env.world_size
        dist.all_gather_object(lengths, len(loader(env.world_size, env.rank, 0, workers)))
        assert len(set(lengths)) == 1, lengths
        steps = EPOCHS * lengths[0]
        schedule = scheduler(sched, opt if attach == "wrapper" else inner, steps)

        def average(value: float) -> float:
            total = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(total)
            return total.item() / env.world_size

        lrs = run_loop(_Passthrough(model), opt, schedule, sched,
                       lambda e: ([b] for b in loader(env.world_size, env.rank, e, workers)),
                       env.world_size, average)
        model.synchronize()
        name = f"{mode}{', sharded' if sharded else ''}"
        worst[name] = max((a - b).abs().max().item()
                          for a, b in zip(net.parameters(), ref.parameters()))
        worst[f"{name}: lr"] = max(abs(a - b) for a, b in zip(lrs, ref_lrs))
        model.close()
    env.finalize()
    return worst


class _Passthrough:
    """The loop's ``net``: the DataParallel model (its ``eval()``/``train()`` too)."""

    def __init__(self, model: DataParallel) -> None:
        self.model = model

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def eval(self) -> None:
        self.model.eval()

    def train(self) -> None:
        self.model.train()


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_sampler_with_set_epoch_trains_as_one_process(world: int) -> None:
    # DataLoader workers (num_workers=2) matched too when run alone, but in the whole suite
    # rank 2 of 3 once stalled outside any collective after its loader forked its workers (a
    # fork of a fork of this long-lived pytest process); as fresh interpreters (spawn) the
    # case costs ~20 s, so the suite runs the loader in-process (stop 52's note: open).
    for worst in run_ranks(world, body_train, "none", "wrapper", 0, timeout=90):
        assert max(worst.values()) < 1e-12, worst


@pytest.mark.parametrize("attach", ["wrapper", "inner"])
@pytest.mark.parametrize("sched", ["OneCycleLR", "LambdaLR", "CosineAnnealingLR", "StepLR",
                                   "ReduceLROnPlateau"])
def test_lr_schedulers_step_each_update_with_its_own_lr(sched: str, attach: str) -> None:
    for worst in run_ranks(2, body_train, sched, attach, 0, timeout=90):
        assert max(worst.values()) < 1e-12, worst


STEPS = 4


def batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g, dtype=dtype), torch.randint(0, 3, (4,), generator=g)


def loss_of(net: Any, x: torch.Tensor, y: torch.Tensor, idiom: str) -> torch.Tensor:
    if idiom == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(net(x), y)
    return F.cross_entropy(net(x), y)


def evaluate(net: Any, frozen: bool) -> torch.Tensor:
    """DDP's evaluation phase: ``train(False)`` (and, ``frozen``, ``requires_grad_(False)``
    on the whole model), a forward, then back."""
    net.train(False)
    if frozen:
        net.requires_grad_(False)
        out = net(validation()[0].to(DTYPE[0]))
        net.requires_grad_(True)
    else:
        with torch.no_grad():
            out = net(validation()[0].to(DTYPE[0]))
    net.train(True)
    return out.detach().double()


DTYPE = [torch.float64]  # (autocast: float32, set in each process)


def idiom_reference(world: int, idiom: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """Every rank's batch in one process (autocast: each rank's forward on its own); the
    model and the evaluations after each step."""
    net = make_net().to(DTYPE[0])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    evals = [evaluate(net, False)]
    for step in range(STEPS):
        for rank in range(world):
            x, y = batch(step, rank, DTYPE[0])
            (loss_of(net, x, y, idiom) / world).backward()
        opt.step()
        opt.zero_grad()
        evals.append(evaluate(net, False))
    return net, evals


def body_idiom(idiom: str) -> dict[str, float]:
    """``idiom`` in a short training: ``eval first`` / ``eval twice first`` (rank 0 alone
    evaluates before the first step), ``autocast``, ``frozen phase`` (every rank evaluates
    with the whole model frozen after each step), ``eval phase`` (``train(False)`` and
    ``no_grad()``)."""
    DTYPE[0] = torch.float32 if idiom == "autocast" else torch.float64
    env = scaleout.init(timeout=20)
    ref, ref_evals = idiom_reference(env.world_size, idiom)
    worst: dict[str, float] = {}
    for mode, sharded in MODES:
        net = make_net().to(DTYPE[0])
        model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                   model, mode=mode)
        evals = []
        if env.rank == 0 and idiom.startswith("eval") and idiom.endswith("first"):
            for _ in range(2 if "twice" in idiom else 1):
                evals.append(evaluate(model, False))
        for step in range(STEPS):
            x, y = batch(step, env.rank, DTYPE[0])
            loss_of(model, x, y, idiom).backward()
            opt.step()
            opt.zero_grad()
            if idiom.endswith("phase"):
                evals.append(evaluate(model, idiom == "frozen phase"))
        model.synchronize()
        name = f"{mode}{', sharded' if sharded else ''}"
        worst[name] = max((a - b).abs().max().item()
                          for a, b in zip(net.parameters(), ref.parameters()))
        expected = ref_evals[1:] if idiom.endswith("phase") else ref_evals[:1] * len(evals)
        if evals:
            worst[f"{name}: evaluations"] = max((a - b).abs().max().item()
                                                for a, b in zip(evals, expected))
        model.close()
    env.finalize()
    return worst


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("idiom", ["eval first", "eval twice first", "frozen phase",
                                   "eval phase"])
def test_evaluation_idioms_before_and_during_training(idiom: str, world: int) -> None:
    for worst in run_ranks(world, body_idiom, idiom, timeout=90):
        assert max(worst.values()) < 1e-12, worst


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_autocast_bf16_trains_as_one_process(world: int) -> None:
    """bf16 rounds each product to 2^-8 of its size: at 3 ranks, where the float32 sum of
    the gradients may be ordered otherwise than here, a last-bit difference flips roundings
    in later forwards (1.4e-4 after 4 steps); at 2 ranks the sum is exact. The three modes
    agree with each other exactly."""
    for worst in run_ranks(world, body_idiom, "autocast", timeout=90):
        assert max(worst.values()) < (1e-12 if world == 2 else 1e-3), worst
        assert len(set(worst.values())) == 1, worst
