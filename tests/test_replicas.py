"""verify_replicas: a replica changed on one rank is caught at the next check on every rank,
naming the first diverging parameter, the odd rank(s) and the values; exact runs pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch.replicas import replica_interval


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> None:
    for step in range(steps):
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def body_diverged(odd: int) -> dict:
    from scaleout.pytorch import DataParallel, DistributedOptimizer, ReplicaDivergenceError

    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DataParallel(net, verify_replicas=2)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    _train(model, opt, 2, env.rank)
    model.synchronize()
    if env.rank == odd:  # one replica drifts: a weight changed on this rank alone
        with torch.no_grad():
            net[2].weight[1, 5] += 0.25
            net[0].bias[0] += 1.0  # a later parameter too: the first one is named
    try:
        _train(model, opt, 3, env.rank)
    except ReplicaDivergenceError as err:
        result = {"message": str(err), "parameter": err.parameter, "ranks": err.ranks,
                  "step": err.step}
    else:
        result = {}
    model.close()
    env.finalize()
    return result


@pytest.mark.parametrize("world, odd", [(2, 1), (3, 2)])
def test_a_diverged_replica_is_named_on_every_rank(world: int, odd: int) -> None:
    results = run_ranks(world, body_diverged, odd, timeout=60)
    for rank, result in enumerate(results):
        assert result, f"rank {rank} did not notice the diverged replica"
        # the check due after 2 exchanges runs before the next forward: after the change
        assert result["parameter"] == "0.bias" and result["ranks"] == [odd]
        assert result["step"] == 2
        message = result["message"]
        assert message.startswith(f"rank {rank}: replicas differ after 2 steps")
        assert f"rank {odd} differs from rank 0" in message
        assert "first differing element 0.bias[0]" in message
        assert "the first of 2 that differ" in message


def body_exact(distributed_update: bool, compression: str | None) -> int:
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DataParallel(net, verify_replicas=1, distributed_update=distributed_update,
                         compression=compression)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), model)
    _train(model, opt, 5, env.rank)
    model.replicas.check()  # explicit check, after the last step
    checked = model.replicas.exchanges
    model.close()
    env.finalize()
    return checked


@pytest.mark.parametrize("distributed_update, compression",
                         [(False, None), (True, None), (False, "topk:ratio=0.25")])
def test_exact_runs_are_not_flagged(distributed_update: bool, compression: str | None) -> None:
    assert run_ranks(3, body_exact, distributed_update, compression, timeout=60) == [5] * 3


def body_disagree() -> str:
    from scaleout.pytorch import DataParallel

    env = scaleout.init(timeout=30)
    try:
        DataParallel(nn.Linear(4, 2), verify_replicas=env.rank + 1)
    except ValueError as err:
        return str(err)
    finally:
        env.finalize()
    return ""


def test_ranks_with_different_intervals_fail_at_construction() -> None:
    # (with DataParallel's other options, before anything else is built: stop 21)
    for message in run_ranks(2, body_disagree, timeout=60):
        assert "DataParallel options" in message and "verify_replicas 1" in message, message
        assert "rank 1: DataParallel options" in message and "verify_replicas 2" in message


def test_interval_argument_and_variable_are_checked() -> None:
    assert replica_interval(None, {}) == 0
    assert replica_interval(None, {"SCALEOUT_VERIFY_REPLICAS": " 25 "}) == 25
    assert replica_interval(7, {"SCALEOUT_VERIFY_REPLICAS": "25"}) == 7
    for bad in (1.5, "3", True):
        with pytest.raises(TypeError, match="verify_replicas must be an int"):
            replica_interval(bad)
    with pytest.raises(ValueError, match=">= 0"):
        replica_interval(-1)
    with pytest.raises(ValueError, match="SCALEOUT_VERIFY_REPLICAS"):
        replica_interval(None, {"SCALEOUT_VERIFY_REPLICAS": "often"})
