"""A layer used by some ranks and not others, from the very first step, trains exactly like
DDP with ``find_unused_parameters=True``: the single-process reference sums every rank's loss
with that rank's own pattern, and a parameter no rank used is not updated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer

STEPS, PER_RANK = 5, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.extra = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use: tuple[bool, bool]) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if use[0]:
            h = h + torch.tanh(self.extra(h))
        if use[1]:
            h = h + torch.tanh(self.other(h))
        return self.fc2(h)


def pattern(step: int, rank: int) -> tuple[bool, bool]:
    """Step 0: only rank 0 runs ``extra`` (first forward orders differ); step 2: nobody
    runs ``other``; the last rank skips ``other`` always."""
    last = rank == 2
    return ((step, rank) in {(0, 0), (1, 1), (3, 0), (3, 1), (4, 2)},
            step != 2 and not last and (step, rank) != (0, 0))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return (torch.randn(PER_RANK, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (PER_RANK,), generator=g))


def reference(world: int, mode: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = Net().double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        used = set()
        for rank in range(world):
            x, y = batch(step, rank)
            use = pattern(step, rank)
            used |= {i for i, u in enumerate(use) if u}
            (F.cross_entropy(net(x, use), y) / world).backward()
        for i, module in enumerate((net.extra, net.other)):
            if i not in used:  # DDP: no rank used it, so it has no gradient and no update
                for p in module.parameters():
                    p.grad = None
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def body(mode: str) -> list[list[float]]:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = Net().double()
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model,
                               mode=mode)
    for step in range(STEPS):
        x, y = batch(step, env.rank)
        F.cross_entropy(model(x, pattern(step, env.rank)), y).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    for got, want in zip(net.parameters(), reference(env.world_size, mode)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
    model.close()
    env.finalize()
    return [p.detach().reshape(-1).tolist() for p in net.parameters()]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["overlap", "sync"])
def test_rank_dependent_usage_from_the_first_step_is_exact(world: int, mode: str) -> None:
    results = run_ranks(world, body, mode, timeout=90)
    assert all(r == results[0] for r in results)
