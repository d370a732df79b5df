"""DistributedOptimizer as torch's tools use it: an LR scheduler still drives the learning rate
after a checkpoint is loaded, and an optimizer over some of the parameters trains them alone,
with the sharded update as without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import checkpoint
from scaleout.pytorch import DataParallel, DistributedOptimizer


def body_scheduler_after_load(path: str) -> float:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)  # lr 0 after a step
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    checkpoint.save(path, model, opt, step=1)
    checkpoint.load(path, model, opt)  # the scheduler was made before: it must still steer
    sched.step()
    assert opt.param_groups is opt.inner.param_groups
    assert opt.inner.param_groups[0]["lr"] == 0.0
    model.synchronize()
    before = net.weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.synchronize()
    change = (net.weight - before).abs().max().item()
    model.close()
    env.finalize()
    return change


def test_a_scheduler_steers_the_learning_rate_after_a_load(tmp_path: Path) -> None:
    changes = run_ranks(2, body_scheduler_after_load, str(tmp_path / "run"), timeout=60)
    assert changes == [0.0, 0.0]  # lr 0: nothing moves


def body_subset(sharded: bool) -> list[list[float]]:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.9),
                               model)  # the head is not trained
    head = [p.detach().clone() for p in net[2].parameters()]
    torch.manual_seed(1 + env.rank)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    assert all(torch.equal(p, h) for p, h in zip(net[2].parameters(), head))
    values = [p.detach().reshape(-1).tolist() for p in net.parameters()]
    model.close()
    env.finalize()
    return values


@pytest.mark.parametrize("world", [2, 3])
def test_an_optimizer_over_some_parameters_with_the_sharded_update(world: int) -> None:
    replicated = run_ranks(world, body_subset, False, timeout=60)
    sharded = run_ranks(world, body_subset, True, timeout=60)
    for r, s in zip(replicated, sharded):
        for a, b in zip(r, s):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
