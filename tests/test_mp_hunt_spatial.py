"""Spatial batch norm in evaluation mode: the affine weights' gradients span every rank's rows.

In evaluation mode ``SpatialBatchNorm`` normalised with its running statistics and the plain
weight and bias, so each rank's weight/bias gradient was its own block's share only (not
summed over the model group): on 3 ranks 0.03-0.05 off the unsplit layer's, and under
DataParallel (which registers them as replicated) the ranks' copies drifted apart. Frozen
statistics with trained affine weights (``bn.eval()`` while fine-tuning) is common.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch.spatial import spatial_parallel, split_rows


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)).double()


def body_eval_gradients(train_first: bool) -> float:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, env.world_size)
    plain, split = net(), spatial_parallel(net(), dist)
    x = torch.randn(3, 2, 12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if train_first:  # running statistics of one batch, then frozen
        plain(x), split(split_rows(x, dist))
    plain.eval(), split.eval()
    xs = split_rows(x, dist).clone().requires_grad_()
    xp = x.clone().requires_grad_()
    weights = torch.linspace(-1, 1, 6, dtype=torch.float64).view(3, 2)
    (plain(xp) * weights).sum().backward()
    (split(xs) * weights).sum().backward()
    worst = (split_rows(xp.grad, dist) - xs.grad).abs().max().item()
    for p, q in zip(plain.parameters(), split.parameters()):
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    env.finalize()
    return worst


@pytest.mark.parametrize("train_first", [False, True])
def test_eval_mode_batch_norm_gradients_equal_the_unsplit_layers(train_first: bool) -> None:
    assert max(run_ranks(3, body_eval_gradients, train_first, timeout=30)) < 1e-12
