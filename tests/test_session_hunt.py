"""Defects found at stop 51 in the session object model and in splitting data over ranks:
a second increment start, fractional byte counts, totals titled per iteration, sampler
progress lost at another size, and digits examples whose ranks took different numbers of
steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import scaleout
import scaleout.horovod as hvd
from harness import run_ranks, scaleout_run
from scaleout import ParameterSetSpec, SchedulerConfig, Session

SIZES = [3, 700, 50, 1, 129, 400]  # one fused bucket of 1,283 elements
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


def body_two_ranks(state_dir: str) -> tuple[dict[str, dict], list[int]]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    # a second start_increment_comm replaced the first (never waited for) without a word
    sharded = Session(env)
    op = sharded.add_operation("fc", dist, parameter_sets=[
        ParameterSetSpec(count=6, distributed_update=True)])
    sharded.commit()
    ps = op.parameter_sets[0]
    ps.start_gradient_comm(torch.ones(6))
    ps.wait_gradient_comm(timeout=10)
    ps.start_increment_comm(torch.full((ps.owned_valid,), float(env.rank)))
    with pytest.raises(RuntimeError, match="start_increment_comm on fc.0: already started; "
                                           "call wait_increment_comm"):
        ps.start_increment_comm(torch.full((ps.owned_valid,), 10.0))
    assert ps.wait_increment_comm(timeout=10).tolist() == [0.0] * 3 + [1.0] * 3
    sharded.close()
    # the members of a fused bucket got its bytes as floats (8399.999999999998 of 8,400)
    fused = Session(env, scheduler=SchedulerConfig(policy="fifo"))
    ops = [fused.add_operation(f"l{i}", dist, parameter_sets=[ParameterSetSpec(count=n)])
           for i, n in enumerate(SIZES)]
    fused.commit()
    assert len(fused.buckets) == 1
    for _ in range(3):
        for layer, n in zip(reversed(ops), reversed(SIZES)):
            layer.parameter_sets[0].start_gradient_comm(torch.ones(n))
        for layer in ops:
            layer.parameter_sets[0].wait_gradient_comm(timeout=10)
    stats = fused.statistics.as_dict()
    # no end_iteration() yet: the table gave three steps' totals "per iteration, 0 iterations"
    assert fused.statistics.table().startswith("Statistics (total: no end_iteration() yet, 0 ")
    fused.statistics.end_iteration()
    assert fused.statistics.table().startswith("Statistics (per iteration, 1 iterations)")
    fused.close()
    # an elastic commit halfway through an epoch, each rank two samples in
    os.environ["SCALEOUT_STATE_DIR"] = state_dir
    hvd.init(timeout=30)  # (attached to the running job)
    sampler = hvd.elastic.ElasticSampler(range(12), shuffle=False)
    state = hvd.elastic.TorchState(None, None, sampler=sampler, epoch=0)
    done = sampler.get_indices(0, 2)
    sampler.record_batch(0, 2)
    state.commit()
    hvd.shutdown()
    env.finalize()
    return stats, done


def body_resume(state_dir: str) -> list[int]:
    os.environ["SCALEOUT_STATE_DIR"] = state_dir
    hvd.init(timeout=30)
    sampler = hvd.elastic.ElasticSampler(range(12), shuffle=False)
    state = hvd.elastic.TorchState(None, None, sampler=sampler, epoch=0)
    assert state.resume()
    state.sync()
    hvd.shutdown()
    return list(sampler)


def test_session_misuse_statistics_and_sampler_progress_at_another_size(tmp_path) -> None:
    results = run_ranks(2, body_two_ranks, str(tmp_path), timeout=90)
    stats = results[0][0]
    for i, n in enumerate(SIZES):
        assert stats[f"l{i}"]["raw_bytes"] == 3 * 4 * n, stats[f"l{i}"]
        assert isinstance(stats[f"l{i}"]["bytes"], int), stats[f"l{i}"]
    assert stats["total"]["bytes"] == stats["total"]["raw_bytes"] == 3 * 4 * sum(SIZES)
    processed = {i for _, done in results for i in done}
    assert processed == {0, 1, 2, 3}
    # resumed at 3 ranks, every rank loads rank 0's commit: rank 1's samples came back
    left = run_ranks(3, body_resume, str(tmp_path), timeout=90)
    assert not processed & {i for indices in left for i in indices}, left
    assert sorted({i for indices in left for i in indices}) == list(range(4, 12))


def test_digits_example_takes_as_many_steps_on_every_rank() -> None:
    # 1,438 images in shards of 479, 479 and 480: 14 steps of 32 on ranks 0 and 1, 15 on
    # rank 2, whose last step waited for the others until the job's timeout (300 s)
    pytest.importorskip("sklearn")
    done = scaleout_run("-n", "3", str(EXAMPLE), "--epochs", "1", "--batch", "96",
                        "--model", "mlp", timeout=90)
    assert "14 steps/epoch" in done.stdout and "epoch  1/1" in done.stdout, done.stdout[-2000:]
