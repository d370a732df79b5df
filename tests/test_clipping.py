"""Gradient clipping on the averaged gradients (global norm over every layer), in overlap and
sync mode, equal to DDP-style ``clip_grad_norm_`` after backward; a warning when ``.grad`` is
clipped by hand after it left; ``module_state_dict()`` loads into the bare module."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer

STEPS, PER_RANK, MAX_NORM = 4, 6, 0.05


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(PER_RANK, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (PER_RANK,), generator=g))


def reference(world: int) -> list[torch.Tensor]:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        for rank in range(world):
            x, y = batch(step, rank)
            (F.cross_entropy(model(x), y) / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def body(mode: str) -> None:
    env = scaleout.init(timeout=30)
    model = DataParallel(net(), env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model,
                               mode=mode, max_grad_norm=MAX_NORM)
    for step in range(STEPS):
        x, y = batch(step, env.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    bare = net()
    bare.load_state_dict(model.module_state_dict())  # keys of the bare module
    for got, want in zip(bare.parameters(), reference(env.world_size)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
    model.close()
    env.finalize()


@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_max_grad_norm_clips_the_global_norm_of_averaged_gradients(mode: str) -> None:
    run_ranks(2, body, mode, timeout=60)


def body_late_clip() -> str:
    env = scaleout.init(timeout=30)
    model = DataParallel(net(), env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = batch(0, env.rank)
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # too late: sent
    with pytest.raises(RuntimeError) as info:
        opt.step()
    model.close()
    env.finalize()
    return str(info.value)


def test_clipping_grad_by_hand_in_overlap_mode_is_refused() -> None:
    """Before stop 49 a warning, once, and the step went on without the clipping."""
    said = run_ranks(2, body_late_clip, timeout=60)[0]
    assert "was changed in place or replaced after its communication started" in said, said
    assert "max_grad_norm" in said, said


def test_max_grad_norm_is_checked() -> None:
    env = scaleout.init(timeout=10)
    model = DataParallel(net(), env.create_distribution())
    for bad in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="max_grad_norm"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                 max_grad_norm=bad)
    model.close()
    env.finalize()


def body_clip_without_gradients() -> list[float]:
    from scaleout.pytorch.clipping import clip_global_norm
    from scaleout.pytorch.tensor_parallel import tensor_parallel

    env = scaleout.init(timeout=5)
    dist = env.create_distribution(1, 2)
    model = tensor_parallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), dist)
    if env.rank == 0:  # rank 1's parameters have no gradient (a layer it did not use)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    clip_global_norm(list(model.parameters()), 1e-3, dist.communicator(scaleout.GroupType.MODEL))
    norm = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    env.finalize()
    return [norm]


def test_a_model_rank_without_gradients_still_joins_the_global_norm() -> None:
    # since stop 52: that rank returned before the model group's all-reduce, and the other
    # waited out the timeout (5 s here)
    norms = run_ranks(2, body_clip_without_gradients, timeout=60)
    assert norms[1] == [0.0] and 0.0 < norms[0][0] <= (1e-3) ** 2 * 1.01
