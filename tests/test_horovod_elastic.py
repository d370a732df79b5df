"""``hvd.elastic`` on scaleout's restarts: a Horovod-style elastic script whose rank dies once
ends, under ``scaleout run --max-restarts 1``, with the weights of an uninterrupted run; the
state objects commit, restore and sync at 2 and 3 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout.horovod as hvd
from harness import run_ranks

SRC = str(Path(__file__).parents[1] / "src")

# 48 samples, 2 ranks, batches of 4: 6 steps per epoch, 2 epochs; a commit every 2 steps.
# With "kill", rank 1 SIGKILLs itself at step 9 on the first attempt (mid-epoch 1, one step
# after the commit at step 8): the restart resumes at step 8 with the sampler's progress.
ELASTIC = """
    import hashlib, os, signal, sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import scaleout.horovod as hvd

    hvd.init(timeout=30)
    attempt = int(os.environ["SCALEOUT_RESTART_COUNT"])
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 2, (48,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, steps=0)
    state.register_reset_callbacks(
        [lambda: print(f"reset: attempt {attempt} resumes at step {state.steps}")])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 2):
            sampler.set_epoch(state.epoch)
            for batch, (x, y) in enumerate(loader):
                if sys.argv[1] == "kill" and attempt == 0 and hvd.rank() == 1 and state.steps == 9:
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                sampler.record_batch(batch, 4)
                state.steps += 1
                if state.steps % 2 == 0:
                    state.commit()

    train(state)
    data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print(f"final steps={state.steps} weights={hashlib.sha256(data).hexdigest()}")
    sys.stdout.flush()
    hvd.shutdown()
    os._exit(0)  # see _TEARDOWN in test_launcher.py
"""


def scaleout_run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("SCALEOUT_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "scaleout", "run", *args], env=env,
                          capture_output=True, text=True, timeout=90)


def test_elastic_script_survives_a_killed_rank(tmp_path: Path) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(textwrap.dedent(ELASTIC))
    plain = scaleout_run("-n", "2", str(script), "plain")
    killed = scaleout_run("-n", "2", "--max-restarts", "1", str(script), "kill")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "rank 1 failed first, with signal SIGKILL" in killed.stdout
    assert "[rank 0] reset: attempt 1 resumes at step 8" in killed.stdout
    assert "reset:" not in plain.stdout
    final = re.compile(r"\[rank \d\] final steps=12 weights=([0-9a-f]{64})")
    expected = set(final.findall(plain.stdout))
    assert len(expected) == 1 and len(final.findall(plain.stdout)) == 2
    assert set(final.findall(killed.stdout)) == expected, (plain.stdout, killed.stdout)


def body_states(directory: str) -> list[object]:
    os.environ["SCALEOUT_STATE_DIR"] = directory
    hvd.init(timeout=30)
    r = hvd.rank()
    torch.manual_seed(r)  # different weights per rank: sync must give rank 0's
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = hvd.elastic.TorchState(model, opt, epoch=r, names=["a"])
    state.sync()
    synced = [state.epoch, model.weight.detach().clone()]
    state.epoch = 5
    model.weight.data.fill_(1.0)
    state.commit()
    state.epoch = 6
    model.weight.data.fill_(2.0)
    state.restore()
    restored = [state.epoch, model.weight.detach().clone()]
    # a fresh state (as in a restarted process) resumes from the persisted commit
    fresh_model = nn.Linear(3, 2)
    fresh = hvd.elastic.TorchState(fresh_model, torch.optim.SGD(fresh_model.parameters(), lr=0.1),
                                   epoch=0, names=[])
    resumed = fresh.resume()
    errors = []
    try:
        hvd.elastic.ObjectState(thing=object()).commit()
    except TypeError as err:
        errors.append(str(err))
    try:
        hvd.elastic.run(lambda s: s)(None)
    except TypeError as err:
        errors.append(str(err))
    hvd.shutdown()
    return [synced, restored, resumed, fresh.epoch, fresh.names,
            fresh_model.weight.detach().clone(), errors]


@pytest.mark.parametrize("world", [2, 3])
def test_state_commit_restore_sync(tmp_path: Path, world: int) -> None:
    results = run_ranks(world, body_states, str(tmp_path), timeout=60)
    root_weight = results[0][0][1]
    for synced, restored, resumed, epoch, names, weight, errors in results:
        assert synced[0] == 0 and torch.equal(synced[1], root_weight)
        assert restored[0] == 5 and torch.equal(restored[1], torch.ones(2, 3))
        assert resumed and epoch == 5 and names == ["a"]
        assert torch.equal(weight, torch.ones(2, 3))
        assert "commit of 'thing': cannot send an object of type object" in errors[0]
        assert "must be an hvd.elastic State" in errors[1]


def test_sampler_partitions_what_is_left() -> None:
    def body() -> list[object]:
        hvd.init(timeout=30)
        sampler = hvd.elastic.ElasticSampler(range(10), shuffle=False)
        first = list(sampler)
        sampler.record_batch(0, 2)  # each rank did its first two samples
        sampler.sync()
        rest = list(sampler)
        sampler.set_epoch(sampler.epoch)  # the same epoch again keeps the progress
        kept = list(sampler)
        sampler.set_epoch(1)
        hvd.shutdown()
        return [first, rest, kept, len(sampler)]

    rank0, rank1 = run_ranks(2, body, timeout=60)
    assert rank0[0] == [0, 2, 4, 6, 8] and rank1[0] == [1, 3, 5, 7, 9]
    assert rank0[1] == [4, 6, 8] and rank1[1] == [5, 7, 9]
    assert rank0[2] == [4, 6, 8] and rank0[3] == 5
