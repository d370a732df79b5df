"""Checkpoints: a resumed run continues bit-identically (per-rank codec residuals, optimizer
state, RNG); a SIGKILL at any moment of a save leaves the previous checkpoint loadable."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import checkpoint


def make(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
    model = DataParallel(net,
                         compression="topk:ratio=0.1")
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), model)
    return net, model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 64) + rank  # drawn from the (restored) RNG: per-rank data
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def body_resume(path: str) -> bool:
    env = scaleout.init(timeout=30)
    net, model, opt = make(seed=0)
    train(model, opt, 4, env.rank)
    checkpoint.save(path, model, opt, step=4, extra={"note": "after 4"})
    expected = train(model, opt, 4, env.rank)
    model.synchronize()
    weights = [p.detach().clone() for p in net.parameters()]
    # a fresh model, optimizer and RNG (as in a new process), then the checkpoint
    torch.manual_seed(123)
    net2, model2, opt2 = make(seed=99)
    step, extra = checkpoint.load(path, model2, opt2)
    assert (step, extra) == (4, {"note": "after 4"})
    resumed = train(model2, opt2, 4, env.rank)
    model2.synchronize()
    assert resumed == expected, (resumed, expected)
    assert all(torch.equal(a, b.detach()) for a, b in zip(weights, net2.parameters()))
    env.finalize()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_resume_is_bit_identical(tmp_path: Path, world: int) -> None:
    assert run_ranks(world, body_resume, str(tmp_path / "ckpt"), timeout=90) == [True] * world
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [f"rank-{r}-of-{world}.pt" for r in range(world)]


def _saver(path: str, step: int, ready: Connection) -> None:
    """Save again and again until killed (a forked child: no interpreter start-up per save
    process, the same SIGKILL at any moment of a save)."""
    model = nn.Linear(2048, 1024)  # 8 MB of weights, 16 MB with the momentum buffers
    with torch.no_grad():
        model.weight.fill_(float(step))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2048)).sum().backward()
    opt.step()
    ready.send("saving")
    for _ in range(1000):
        checkpoint.save(path, model, opt, step=step)


def _start_saver(path: Path, step: int) -> multiprocessing.Process:
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe(duplex=False)
    saver = context.Process(target=_saver, args=(str(path), step, theirs), daemon=True)
    saver.start()
    assert ours.poll(60) and ours.recv() == "saving"
    return saver


def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    first = _start_saver(path, 1)
    deadline = time.monotonic() + 30
    while not path.is_symlink() and time.monotonic() < deadline:  # one save committed
        time.sleep(0.01)
    time.sleep(0.1)  # (into a later one)
    os.kill(first.pid, signal.SIGKILL)
    first.join()
    for delay in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
        saver = _start_saver(path, 2)
        time.sleep(delay)
        os.kill(saver.pid, signal.SIGKILL)
        saver.join()
        model = nn.Linear(2048, 1024)
        step, _ = checkpoint.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                               momentum=0.9))
        assert step in (1, 2)
        assert torch.all(model.weight != 0)
    leftovers = list((tmp_path / "ckpt.versions").iterdir())
    assert len(leftovers) <= 3  # the committed version plus at most the ones cut short


def body_sharded_resume(folder: str) -> list[float]:
    """Resume with the sharded (distributed) update: the optimizer's owned-slice copies take
    the loaded weights (an lr=0 step after loading must leave them unchanged)."""
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))
    model = DataParallel(net, distributed_update=True)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), model)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    saved = {k: torch.full_like(v, 7.0) for k, v in model.module_state_dict().items()}
    model.module.load_state_dict(saved)  # the bare module: DataParallel's copies go stale
    model.load_state_dict(model.state_dict())  # through DataParallel: they are refreshed
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.synchronize()
    means = [p.detach().mean().item() for p in net.parameters()]
    model.close()
    env.finalize()
    return means


def test_sharded_update_resumes_with_the_loaded_weights(tmp_path: Path) -> None:
    for means in run_ranks(2, body_sharded_resume, str(tmp_path), timeout=60):
        assert means == [7.0] * 4, means


def body_ranks_see_different_versions(folder: str) -> str:
    """Rank 0 uses a path at its first version, rank 1 another path at its second: as ranks
    would on a shared file system that shows them different versions of one path. Neither a
    load nor a save goes ahead."""
    env = scaleout.init(timeout=30)
    net, model, opt = make(seed=0)
    checkpoint.save(f"{folder}/a", model, opt, step=1)
    checkpoint.save(f"{folder}/b", model, opt, step=1)
    checkpoint.save(f"{folder}/b", model, opt, step=2)
    before = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    changed = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="different versions") as caught:
        checkpoint.load(f"{folder}/{'a' if env.rank == 0 else 'b'}", model, opt)
    assert all(torch.equal(p, c) for p, c in zip(net.parameters(), changed))  # nothing loaded
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    if env.rank == 0:  # rank 1 finds none where rank 0 finds one: a ValueError on both ranks
        with pytest.raises(ValueError, match="rank 1: none"):
            checkpoint.load(f"{folder}/a", model, opt)
    else:
        with pytest.raises(ValueError, match="rank 1: none"):
            checkpoint.load(f"{folder}/missing", model, opt)
    with pytest.raises(ValueError, match="nothing was saved"):  # the new versions would differ
        checkpoint.save(f"{folder}/{'a' if env.rank == 0 else 'b'}", model, opt, step=3)
    checkpoint.save(f"{folder}/b", model, opt, step=3)  # the same version everywhere: saved
    assert checkpoint.load(f"{folder}/b", model, opt)[0] == 3
    env.finalize()
    return str(caught.value)


def test_ranks_that_see_different_versions_load_and_save_nothing(tmp_path: Path) -> None:
    for message in run_ranks(2, body_ranks_see_different_versions, str(tmp_path), timeout=60):
        assert "rank 0: version 0 of 2 ranks, rank 1: version 1 of 2 ranks" in message, message


def body_other_codec(path: str) -> list[str]:
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    net, model, opt = make(seed=0)
    train(model, opt, 3, env.rank)
    checkpoint.save(path, model, opt, step=3)
    said = []
    for spec in ("topk:ratio=0.1", "topk:ratio=0.2", "sign"):
        torch.manual_seed(0)
        net2 = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
        model2 = DataParallel(net2, compression=spec)
        opt2 = DistributedOptimizer(torch.optim.SGD(net2.parameters(), lr=0.05), model2)
        model2(torch.zeros(1, 64))  # (built: the codec state loads at once)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint.load(path, model2, opt2)
        said.append(" | ".join(str(w.message) for w in caught))
        residuals = [t for entry in model2._session.compression_state_dict().values()
                     for state in entry["states"].values() for t in state["buffers"].values()]
        said.append(f"residuals {sum(float(t.abs().sum()) for t in residuals) > 0}")
    env.finalize()
    return said


def test_codec_state_saved_by_another_codec_is_reset_with_a_warning(tmp_path: Path) -> None:
    """Before stop 49 topk's residuals loaded into another codec's (or topk at another
    ratio) without a word."""
    said = run_ranks(2, body_other_codec, str(tmp_path / "ckpt"), timeout=90)[0]
    assert said[:2] == ["", "residuals True"], said
    for i in (2, 4):
        assert "is reset" in said[i] and "it was saved by TopK" in said[i], said[i]
        assert said[i + 1] == "residuals False", said
