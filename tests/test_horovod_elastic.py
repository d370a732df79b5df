"""``hvd.elastic`` on scaleout's restarts: a Horovod-style elastic script whose rank dies once
ends, under ``scaleout run --max-restarts 1``, with the weights of an uninterrupted run; the
state objects commit, restore and sync at 2 and 3 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout.horovod as hvd
from harness import run_ranks

SRC = str(Path(__file__).parents[1] / "src")

JOBS = str(Path(__file__).parent / "restart_jobs.py")


def test_elastic_script_survives_a_killed_rank(tmp_path: Path) -> None:
    """``restart_jobs.elastic``: rank 1 dies at step 9 on the first attempt; the restarted
    job resumes from the commit at step 8 and ends with the uninterrupted run's weights
    (that reference comes from the same job run by the forked harness)."""
    from restart_jobs import elastic

    reference = run_ranks(2, elastic, False, timeout=60,
                          env={"SCALEOUT_STATE_DIR": str(tmp_path / "reference")})
    assert len(set(reference)) == 1
    # (heartbeat limit 2 s, not 15: rank 0 names rank 1 and leaves sooner)
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "2"}
    env.pop("SCALEOUT_STATE_DIR", None)
    killed = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2",
                             "--max-restarts", "1", JOBS, "elastic", "kill"], env=env,
                            capture_output=True, text=True, timeout=90)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "rank 1 failed first, with signal SIGKILL" in killed.stdout
    assert "[rank 0] reset: attempt 1 resumes at step 8" in killed.stdout
    final = re.findall(r"\[rank \d\] final weights=([0-9a-f]{64})", killed.stdout)
    assert final == reference, (reference, killed.stdout)


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


def test_sampler_pads_every_rank_when_fewer_samples_are_left_than_ranks() -> None:
    def body() -> list[object]:
        hvd.init(timeout=20)
        sampler = hvd.elastic.ElasticSampler(range(4), shuffle=False)
        if hvd.rank() == 0:
            sampler.record_indices([0, 1, 2])  # one sample left for three ranks
        sampler.sync()
        hvd.shutdown()
        return [list(sampler), len(sampler)]

    # every rank must run as many batches as the others (or their allreduces hang)
    assert run_ranks(3, body, timeout=60) == [[[3], 1]] * 3


def body_resume_unseen(shared: str, empty: str) -> str:
    os.environ["SCALEOUT_STATE_DIR"] = shared
    hvd.init(timeout=10)
    model = nn.Linear(2, 1)
    hvd.elastic.ObjectState(epoch=3).commit()
    # after a restart, rank 1's view of the state directory does not show the commit yet
    os.environ["SCALEOUT_STATE_DIR"] = shared if hvd.rank() == 0 else empty
    state = hvd.elastic.TorchState(model, None, epoch=0)
    try:
        state.resume()
        state.sync()
        return "resumed"
    except ValueError as err:
        return str(err)
    finally:
        hvd.shutdown()


def test_resume_refuses_on_every_rank_when_ranks_see_different_commits(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    results = run_ranks(2, body_resume_unseen, str(tmp_path), str(empty), timeout=60)
    assert all("the ranks see different versions" in text for text in results), results


def body_codec_residuals(directory: str) -> list[object]:
    """A codec's error-feedback residuals go back with the weights: restore() and a resumed
    commit give each rank its own residuals of the commit (rank 0's are never synced)."""
    os.environ["SCALEOUT_STATE_DIR"] = directory
    hvd.init(timeout=30)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    compression = hvd.Compression.codec("topk:ratio=0.25")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    state = hvd.elastic.TorchState(model, opt, epoch=0)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 8) * (hvd.rank() + 1)).square().sum().backward()
        opt.step()

    def residuals(compression: object) -> dict[str, torch.Tensor]:
        return {name: buffer.clone() for name, saved in compression.state_dict().items()
                for buffer in saved["buffers"].values()}

    step()
    state.sync()
    state.commit()
    committed = residuals(compression)
    step()
    moved = residuals(compression)
    state.restore()
    restored = residuals(compression)
    fresh_model, fresh = nn.Linear(8, 4), hvd.Compression.codec("topk:ratio=0.25")
    fresh_opt = hvd.DistributedOptimizer(torch.optim.SGD(fresh_model.parameters(), lr=0.1),
                                         named_parameters=fresh_model.named_parameters(),
                                         compression=fresh)
    assert hvd.elastic.TorchState(fresh_model, fresh_opt, epoch=0).resume()
    resumed = residuals(fresh)
    hvd.shutdown()
    return [committed, moved, restored, resumed]


def body_codec_other_size(directory: str) -> list[object]:
    os.environ["SCALEOUT_STATE_DIR"] = directory
    hvd.init(timeout=30)
    model, compression = nn.Linear(8, 4), hvd.Compression.codec("topk:ratio=0.25")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    with pytest.warns(UserWarning, match="made at 2 ranks, resumed at 3: the codec's error-"):
        assert hvd.elastic.TorchState(model, opt, epoch=0).resume()
    hvd.shutdown()
    return [compression.state_dict()]


def test_codec_residuals_are_committed_per_rank(tmp_path: Path) -> None:
    results = run_ranks(2, body_codec_residuals, str(tmp_path), timeout=60)
    for committed, moved, restored, resumed in results:
        assert committed and committed.keys() == moved.keys() == restored.keys() == resumed.keys()
        assert any(not torch.equal(committed[k], moved[k]) for k in committed)
        assert all(torch.equal(committed[k], restored[k]) for k in committed)
        assert all(torch.equal(committed[k], resumed[k]) for k in committed)
    first, second = results[0][0], results[1][0]  # each rank keeps its own
    assert any(not torch.equal(first[k], second[k]) for k in first)
    # at another size the residuals start afresh (rank 0's would be counted on every rank)
    assert run_ranks(3, body_codec_other_size, str(tmp_path), timeout=60) == [[{}]] * 3
