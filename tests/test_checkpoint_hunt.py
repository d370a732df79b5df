"""Checkpoints as users drive them (stop 51's hunt): the sharded update resumed with a
learning-rate scheduler attached to the wrapped optimizer continues as if uninterrupted, and
the wrapped optimizer itself (which holds no state) is refused by save and load instead of
saving nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import checkpoint

STEPS, SAVE_AT = 6, 3
SCHEDULES = ("exponential", "linear")  # linear: its constructor changes lr (x 0.5)


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)


def make(schedule: str) -> tuple[nn.Module, object, object, object]:
    """(net, DataParallel, DistributedOptimizer, the scheduler on the wrapped Adam)."""
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    model = DataParallel(net, distributed_update=True)
    wrapped = torch.optim.Adam(net.parameters(), lr=0.05)
    opt = DistributedOptimizer(wrapped, model)
    sched = torch.optim.lr_scheduler.ExponentialLR(wrapped, gamma=0.5) \
        if schedule == "exponential" else \
        torch.optim.lr_scheduler.LinearLR(wrapped, start_factor=0.5, total_iters=5)
    return net, model, opt, sched


def train(folder: str, schedule: str, first: int, save_at: int | None) -> list[torch.Tensor]:
    net, model, opt, sched = make(schedule)
    path = f"{folder}/{schedule}"
    by_hand = schedule == "linear"  # the optimizer's state_dict() saved and loaded by hand
    if first:
        step, extra = checkpoint.load(path, model, None if by_hand else opt)
        assert step == first
        if by_hand:
            opt.load_state_dict(extra["opt"])
        sched.load_state_dict(extra["sched"])
    for step in range(first, STEPS):
        x, y = data(step)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step + 1 == save_at:
            extra = {"sched": sched.state_dict()}
            if by_hand:
                extra["opt"] = opt.state_dict()
            checkpoint.save(path, model, None if by_hand else opt, step=step + 1, extra=extra)
    model.synchronize()
    weights = [p.detach().clone() for p in net.parameters()]
    model.close()
    return weights


def body_first(folder: str) -> dict[str, object]:
    """Uninterrupted runs, the same with a save at SAVE_AT, and the wrapped optimizer given
    to save and load."""
    env = scaleout.init(timeout=30)
    out: dict[str, object] = {}
    for schedule in SCHEDULES:
        out[schedule] = (train(folder, schedule, 0, None), train(folder, schedule, 0, SAVE_AT))
    net, model, opt, _ = make("exponential")
    x, y = data(0)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    model.synchronize()
    before = [p.detach().clone() for p in net.parameters()]
    refused = []
    for call in (lambda: checkpoint.save(f"{folder}/wrapped", model, opt._user_optimizer),
                 lambda: checkpoint.load(f"{folder}/exponential", model,
                                         opt._user_optimizer)):
        with pytest.raises(ValueError) as caught:
            call()
        refused.append(str(caught.value))
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    out["refused"] = refused
    model.close()
    env.finalize()
    return out


def body_resume(folder: str) -> dict[str, list[torch.Tensor]]:
    env = scaleout.init(timeout=30)
    out = {schedule: train(folder, schedule, SAVE_AT, None) for schedule in SCHEDULES}
    env.finalize()
    return out


def test_sharded_update_resumes_with_a_scheduler_on_the_wrapped_optimizer(
        tmp_path: Path) -> None:
    """Before stop 51 the checkpoint held the lr of the step before the scheduler's last
    change (0.009 off after 3 resumed steps), and the lr of a scheduler that changes it when
    built (LinearLR) overrode the loaded one (DistributedOptimizer.load_state_dict: 0.04
    off); the wrapped Adam, given to save, saved no state (0.2
    off after the resume)."""
    first = run_ranks(2, body_first, str(tmp_path), timeout=60)
    resumed = run_ranks(2, body_resume, str(tmp_path), timeout=60)
    for rank in range(2):
        for schedule in SCHEDULES:
            uninterrupted, with_save = first[rank][schedule]
            assert all(torch.equal(a, b) for a, b in zip(uninterrupted, with_save))
            gaps = [(a - b).abs().max().item()
                    for a, b in zip(uninterrupted, resumed[rank][schedule])]
            assert gaps == [0.0] * len(gaps), (rank, schedule, gaps)
        assert first[rank]["unchanged"]
        for message in first[rank]["refused"]:
            assert "holds no state" in message and "DistributedOptimizer" in message, message
    assert not (tmp_path / "wrapped").exists()
