"""Where DataParallel's backward ends: at the end of the graph task that reached the model's
output, also when the parameters' gradients arrive in a backward nested inside it (a
reentrant activation checkpoint), and not in a backward that accumulates none (the gradient
of a gradient penalty, ``torch.autograd.grad`` of the output)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

import scaleout
from harness import run_ranks

STEPS = 3


class Net(nn.Module):
    """A layer, then a block run under a reentrant checkpoint (``ckpt``) or plainly: both
    compute the same gradients, bit for bit."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return cp.checkpoint(self.block, h, use_reentrant=True) if self.ckpt else self.block(h)


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(8, 6, generator=g, dtype=torch.float64),
            torch.randn(8, 1, generator=g, dtype=torch.float64))


def body(ckpt: bool, codec: str | None, mode: str, penalty: bool) -> dict[str, torch.Tensor]:
    from scaleout.compression import CompressionConfig
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    net = Net(ckpt).double()
    model = DataParallel(net, env.create_distribution(), compression=None if codec is None
                         else CompressionConfig(codec=codec, min_numel=0))
    with warnings.catch_warnings():  # (a codec's advice for plain SGD)
        warnings.simplefilter("ignore")
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model, mode=mode)
    for step in range(STEPS):
        x, y = data(step, env.rank)
        x.requires_grad_(penalty)
        out = model(x)
        loss = F.mse_loss(out, y)
        if penalty:  # WGAN-GP's: the input gradient's norm, through a backward of its own
            grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = loss + 0.1 * grad.pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    model.close()
    env.finalize()
    return weights


@pytest.mark.parametrize("codec, mode", [(None, "overlap"), ("blockquant", "sync")])
def test_a_reentrant_checkpoint_trains_as_the_plain_model(codec: str | None, mode: str) -> None:
    # the inner backward ended the model's: the first layer went as unused zeros, then again
    # (overlap: "gradient of pre.bias produced again"; sync with blockquant: the block's
    # averaged gradient went through the codec twice, 2.4e-3 off)
    plain = run_ranks(2, body, False, codec, mode, False, timeout=60)
    checkpointed = run_ranks(2, body, True, codec, mode, False, timeout=60)
    for mine, reference in zip(checkpointed, plain):
        for name, value in reference.items():
            assert torch.equal(mine[name], value), name


def reference_with_penalty(world: int) -> dict[str, torch.Tensor]:
    net = Net(False).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        for rank in range(world):
            x, y = data(step, rank)
            x.requires_grad_(True)
            out = net(x)
            grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
            ((F.mse_loss(out, y) + 0.1 * grad.pow(2).sum()) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_gradient_penalty_backward_sends_nothing_of_its_own(mode: str) -> None:
    expected = reference_with_penalty(2)
    for weights in run_ranks(2, body, False, None, mode, True, timeout=60):
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-10, atol=1e-12)
