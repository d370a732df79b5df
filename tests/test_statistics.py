"""Statistics of a DataParallel run: per-layer compute, communication time and bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer


def body() -> dict[str, dict[str, float]]:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model = DataParallel(net, env.create_distribution(), compression={"2.weight": "cast:bf16"})
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    for _ in range(3):
        F.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 32, (8,))).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    stats = model.statistics
    result = stats.as_dict()
    assert stats.iterations == 3
    assert "compute ms" in stats.table()
    model.close()
    env.finalize()
    return result


def test_layers_report_compute_communication_and_bytes() -> None:
    stats = run_ranks(2, body, timeout=60)[0]
    for layer, numel in (("0", 32 * 64 + 64), ("2", 64 * 32 + 32)):
        assert stats[layer]["compute_s"] > 0, stats[layer]
        assert stats[layer]["comm_s"] > 0, stats[layer]
        assert stats[layer]["raw_bytes"] == 3 * 4 * numel  # fp32, three iterations
    # layer 2's weight travels as bf16: fewer bytes than raw; layer 0 goes exact
    assert stats["2"]["bytes"] < stats["2"]["raw_bytes"]
    assert stats["0"]["bytes"] == stats["0"]["raw_bytes"]
