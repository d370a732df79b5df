"""DDP training scripts' idioms, unchanged, on DataParallel (stop 52's hunt): code that runs
on one rank only, and torch.distributed called directly between steps; in overlap mode, sync
mode and with the sharded update, against a float64 single process on the whole batch.

Found wrong (now fixed or refused with an error that says what to do):

- ``if rank == 0: torch.save(model.module.state_dict(), path)`` saved the weights of the
  step before in overlap mode (0.052 off after the third step) and, in every mode, rank 0's
  own BatchNorm running statistics instead of their average (0.022 off in sync mode); every
  rank loading the file trained on from them (0.060 off at the end).
- ``if rank == 0: model.module.eval(); model.module(x_val)`` read rank 0's own running
  statistics (the logits 0.011 off).
- ``if rank == 0: with torch.no_grad(): model(x_val)`` in train mode on a model with
  BatchNorm started the buffers' average on rank 0 alone: both ranks timed out (rank 0 in the
  buffers' all-reduce, rank 1 in its gradients').
- With the sharded update, rank 0's ``opt.state_dict()`` saved and loaded on every rank gave
  rank 1 rank 0's slices of the momentum: "output with shape [1] doesn't match the broadcast
  shape [2]" in its next step, silently wrong where the slices have equal shapes.

Found right, and kept so here: rank-0 evaluation through the wrapper every step (``eval()`` /
``train()``), ``model.state_dict()`` saved on rank 0 and loaded on every rank,
``dist.all_reduce`` / ``dist.barrier`` / ``dist.all_gather_object`` on the default group
between ``backward()`` and ``step()`` and after it, a learning rate set by hand after
``step()`` (overlap mode applies the step's own), and ``clip_grad_norm_`` between backward
and step: applied in sync mode, refused in overlap mode and with the sharded update (naming
``max_grad_norm``, as the DistributedOptimizer's docstring promises).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from small_models import Conv
from scaleout.pytorch import DataParallel, DistributedOptimizer

PER_RANK, STEPS, SAVE_AT = 4, 4, 1
#: (mode, distributed_update)
MODES = [("overlap", False), ("sync", False), ("overlap", True)]


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(PER_RANK, 2, 5, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (PER_RANK,), generator=g))


def validation() -> torch.Tensor:
    return torch.randn(3, 2, 5, 5, generator=torch.Generator().manual_seed(9),
                       dtype=torch.float64)


def lr_at(step: int) -> float:
    return 0.1 / (1 + step)


def reference(world: int) -> tuple[nn.Module, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Every rank's batch in one process (the buffers as DataParallel's: each rank's forward
    from the same values, averaged); the model, its evaluation after each step, and its
    state after step ``SAVE_AT``."""
    torch.manual_seed(0)
    net = Conv().double()
    opt = torch.optim.SGD(net.parameters(), lr=lr_at(0), momentum=0.9)
    evals, saved = [], {}
    for step in range(STEPS):
        start = {name: b.clone() for name, b in net.named_buffers()}
        after = []
        for rank in range(world):
            with torch.no_grad():
                for name, buffer in net.named_buffers():
                    buffer.copy_(start[name])
            x, y = data(step, rank)
            (F.cross_entropy(net(x), y) / world).backward()
            after.append({name: b.clone() for name, b in net.named_buffers()})
        with torch.no_grad():
            for name, buffer in net.named_buffers():
                values = torch.stack([a[name] for a in after])
                buffer.copy_(values.mean(0) if buffer.is_floating_point() else values[-1])
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] = lr_at(step + 1)
        if step == SAVE_AT:
            saved = {k: v.clone() for k, v in net.state_dict().items()}
        net.eval()
        with torch.no_grad():
            evals.append(net(validation()))
        net.train()
    return net, evals, saved


def farthest(mine: dict[str, Any], theirs: dict[str, Any], names: Any = None) -> float:
    """The largest difference between two states' floating entries (those in ``names``)."""
    keys = [k for k in theirs if theirs[k].is_floating_point()
            and (names is None or k in names)]
    return max((mine[k].double() - theirs[k].double()).abs().max().item() for k in keys)


def train(env: Any, mode: str, sharded: bool, idiom: str, folder: str) -> dict[str, Any]:
    """``STEPS`` steps with ``idiom`` after each step (or between backward and step), the
    learning rate set by hand after each step; what rank 0 saw and the final state."""
    torch.manual_seed(0)
    net = Conv().double()
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr_at(0), momentum=0.9),
                               model, mode=mode)
    seen: dict[str, Any] = {"evals": []}
    path = os.path.join(folder, f"{mode}-{sharded}-{idiom}.pt")
    for step in range(STEPS):
        x, y = data(step, env.rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if idiom == "torch.distributed":  # logging between backward and step, and after
            total = loss.detach().clone()
            dist.all_reduce(total)
            dist.barrier()
            gathered: list[Any] = [None] * env.world_size
            dist.all_gather_object(gathered, float(total))
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] = lr_at(step + 1)  # (overlap: this step's update used its own)
        if idiom == "torch.distributed":
            dist.barrier()
        if env.rank == 0 and idiom == "eval wrapper":
            model.eval()
            with torch.no_grad():
                seen["evals"].append(model(validation()))
            model.train()
        if env.rank == 0 and idiom == "eval module":
            model.module.eval()
            with torch.no_grad():
                seen["evals"].append(model.module(validation()))
            model.module.train()
        if idiom.startswith("save") and step == SAVE_AT:
            if env.rank == 0:
                state = model.state_dict() if idiom == "save wrapper" else net.state_dict()
                torch.save(state, path)
                seen["saved"] = {k.removeprefix("module."): v.clone() for k, v in state.items()
                                 if isinstance(v, torch.Tensor)}
            dist.barrier()
            (model if idiom == "save wrapper" else net).load_state_dict(torch.load(path))
    model.synchronize()
    seen["final"] = {k: v.clone() for k, v in net.state_dict().items()}
    model.close()
    return seen


def body(idioms: list[str]) -> dict[str, float]:
    """The largest difference from the reference per (idiom, mode): ``final`` weights (and
    buffers), rank 0's evaluations, the state rank 0 saved."""
    env = scaleout.init(timeout=20)
    ref, evals, saved = reference(env.world_size)
    worst: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = [scratch]
        dist.broadcast_object_list(folder, src=0)  # (rank 0's folder: ranks share the host)
        for mode, sharded in MODES:
            for idiom in idioms:
                seen = train(env, mode, sharded, idiom, folder[0])
                name = f"{idiom}, {mode}{', sharded' if sharded else ''}"
                worst[f"{name}: final"] = farthest(seen["final"], ref.state_dict())
                if seen["evals"]:
                    worst[f"{name}: evaluations"] = max(
                        (a - b).abs().max().item() for a, b in zip(seen["evals"], evals))
                if "saved" in seen:
                    worst[f"{name}: saved"] = farthest(seen["saved"], saved)
        dist.barrier()
    env.finalize()
    return worst


@pytest.mark.parametrize("idiom", ["eval module", "save module"])
def test_rank0_reads_of_the_bare_module_see_the_agreed_weights_and_buffers(idiom: str) -> None:
    for worst in run_ranks(2, body, [idiom], timeout=90):
        assert max(worst.values()) < 1e-12, worst


def test_ddp_idioms_that_held_up() -> None:
    idioms = ["eval wrapper", "save wrapper", "torch.distributed"]
    for worst in run_ranks(2, body, idioms, timeout=120):
        assert max(worst.values()) < 1e-12, worst


def body_sharded_state(save_everywhere: bool) -> str:
    """With the sharded update: rank 0's (or each rank's own) optimizer state saved, loaded
    on every rank, two more steps."""
    env = scaleout.init(timeout=20)
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()  # (8 parameters' elements: equal slices at 2 ranks)
    model = DataParallel(net, env.create_distribution(), distributed_update=True)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model)
    folder = [tempfile.mkdtemp()]
    dist.broadcast_object_list(folder, src=0)
    outcome = "loaded"
    for step in range(4):
        model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            path = os.path.join(folder[0], f"opt.{env.rank if save_everywhere else 0}.pt")
            if save_everywhere or env.rank == 0:
                torch.save(opt.state_dict(), path)
            dist.barrier()
            try:
                opt.load_state_dict(torch.load(path))
            except ValueError as err:
                outcome = str(err)
            flags = [None] * env.world_size
            dist.all_gather_object(flags, outcome == "loaded")
            if not all(flags):  # (what a script would do: stop on every rank)
                break
    model.close()
    env.finalize()
    return outcome


def test_one_ranks_sharded_optimizer_state_is_refused_on_another_rank() -> None:
    assert run_ranks(2, body_sharded_state, True) == ["loaded", "loaded"]
    rank0, rank1 = run_ranks(2, body_sharded_state, False)
    assert rank0 == "loaded"
    assert "holds the slices of data-group rank 0 of 2" in rank1, rank1
    assert "this is rank 1 of 2" in rank1 and "rank 1:" in rank1, rank1


def body_clip(mode: str, sharded: bool) -> str:
    """``clip_grad_norm_`` between backward and step (DDP's idiom), three steps."""
    env = scaleout.init(timeout=20)
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model, mode=mode)
    outcome = "applied"
    try:
        for _ in range(3):
            model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        model.synchronize()
    except RuntimeError as err:
        outcome = str(err)
    model.close()
    env.finalize()
    return outcome


@pytest.mark.parametrize("mode,sharded", MODES)
def test_clip_grad_norm_between_backward_and_step_is_applied_or_refused(
        mode: str, sharded: bool) -> None:
    for outcome in run_ranks(2, body_clip, mode, sharded):
        if mode == "sync" and not sharded:
            assert outcome == "applied"
        else:
            assert "max_grad_norm" in outcome, outcome
