"""Follow-ups of the stop-52 review. Each test failed on the code before it."""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer

STEPS = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(6, 4, generator=gen, dtype=torch.float64),
            torch.randn(6, 2, generator=gen, dtype=torch.float64))


def _sgd(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process, float64: each step on every rank's batch (the mean of their losses)."""
    net = _net()
    opt = _sgd(net.parameters())
    for step in range(STEPS):
        loss = sum(F.mse_loss(net(x), y) for x, y in (_data(step, r) for r in range(world)))
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


# 1. a backward stopped before any gradient left is forgotten ---------------------------------

def _backward_twice(mode: str, sharded: bool) -> dict[str, torch.Tensor]:
    """Every rank runs a second backward without step() at step 1 ("produced again" at its very
    first gradient: nothing of it left), drops it with zero_grad() and trains on."""
    env = scaleout.init(timeout=20)
    net = _net()
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(_sgd(net.parameters()), model, mode=mode)
    refused = 0
    for step in range(STEPS):
        x, y = _data(step, env.rank)
        F.mse_loss(model(x), y).backward()
        if step == 1:
            try:
                F.mse_loss(model(x), y).backward()
            except RuntimeError as err:
                assert "produced again" in str(err), err
                refused += 1
            opt.zero_grad()  # (drops both: the documented way out) and this batch again
            F.mse_loss(model(x), y).backward()  # (before: this forward was refused)
        opt.step()
        opt.zero_grad()
    return {"refused": torch.tensor(refused), **_finish(env, model, net)}


def _finish(env: Any, model: DataParallel, net: nn.Module) -> dict[str, torch.Tensor]:
    """The job's end: the last update landed, the weights copied, the model and job closed."""
    model.synchronize()
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    model.close()
    env.finalize()
    return weights


@pytest.mark.parametrize("mode, sharded", [("overlap", False), ("sync", True)])
def test_a_backward_stopped_before_any_gradient_left_does_not_refuse_the_next_forward(
        mode: str, sharded: bool) -> None:
    # before: the next forward raised "the last backward ... stopped part-way ... after some
    # of its gradients had left for the other ranks", though none had
    results = run_ranks(2, _backward_twice, mode, sharded, timeout=30)
    assert all(int(r.pop("refused")) == 1 for r in results)
    for name, value in _reference(2).items():
        assert torch.equal(results[0][name], results[1][name]), name
        torch.testing.assert_close(results[0][name], value, rtol=1e-9, atol=1e-10)


# 2. rank 0 alone saving between backward() and step() ----------------------------------------

def _save_mid_iteration(sharded: bool) -> dict[str, torch.Tensor]:
    env = scaleout.init(timeout=20)
    net = _net()
    model = DataParallel(net, env.create_distribution(), distributed_update=sharded)
    opt = DistributedOptimizer(_sgd(net.parameters()), model, mode="overlap")
    for step in range(STEPS):
        x, y = _data(step, env.rank)
        F.mse_loss(model(x), y).backward()
        if env.rank == 0 and step % 2 == 1:  # (a DDP script's mid-iteration save)
            model.module.state_dict()
        opt.step()
        opt.zero_grad()
    return _finish(env, model, net)


@pytest.mark.parametrize("sharded", [False, True])
def test_rank_0_saving_between_backward_and_step_keeps_the_ranks_together(sharded: bool) -> None:
    results = run_ranks(2, _save_mid_iteration, sharded, timeout=30)
    reference = _reference(2)
    for name, value in reference.items():
        assert torch.equal(results[0][name], results[1][name]), name
        torch.testing.assert_close(results[0][name], value, rtol=1e-9, atol=1e-10)


# 3. a re-initialised rank 0 meets fresh workers ----------------------------------------------

def _fresh_join(queue: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        env = scaleout.init(timeout=8)
        d = env.create_distribution()
        total = d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait()
        env.finalize()
        queue.put(("ok", total.tolist()))
    except BaseException as err:  # noqa: BLE001
        queue.put(("error", repr(err)))


def _rejoin(fresh: bool) -> list[object]:
    """Two jobs on the same address: rank 0's process joins both; rank 1 joins the second
    from a fresh process (a restarted worker) or from the same one."""
    seen = []
    for job in range(2):
        if job == 1 and fresh and int(os.environ["RANK"]) == 1:
            queue: mp.Queue = mp.get_context("fork").Queue()  # type: ignore[type-arg]
            child = mp.get_context("fork").Process(target=_fresh_join, args=(queue,))
            child.start()
            status, value = queue.get(timeout=20)
            child.join(10)
            assert status == "ok", value
            seen.append(value)
            continue
        env = scaleout.init(timeout=8)
        d = env.create_distribution()
        seen.append(d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait().tolist())
        env.finalize()
    return seen


@pytest.mark.parametrize("fresh", [True, False])
def test_a_reinitialised_rank_0_meets_fresh_and_reinitialised_workers(fresh: bool) -> None:
    # before (fresh): the fresh worker read the first job's salt, still in rank 0's store
    assert run_ranks(2, _rejoin, fresh, timeout=40) == [[[2.0, 2.0]] * 2] * 2


def test_a_late_duplicate_of_an_admitted_job_is_told_so() -> None:
    """Ranks 0 and 1 are admitted; a third process, holding the token, then joins as rank 1.
    Since stop 52 the salt's entry says the job was admitted (a re-joining job waits there for
    its own salt), so the late duplicate waits its timeout and says why."""
    import subprocess
    import sys
    import textwrap
    import time

    from pathlib import Path

    from harness import free_port

    src = str(Path(__file__).resolve().parents[1] / "src")
    port = free_port()
    code = textwrap.dedent(f"""
        import sys, time
        from scaleout.launch.environment import LaunchInfo
        from scaleout.launch.rendezvous import rendezvous
        rank, timeout = int(sys.argv[1]), float(sys.argv[2])
        info = LaunchInfo(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1",
                          master_port={port}, source="test")
        try:
            rendezvous(info, "tok", timeout=timeout)
        except Exception as err:
            print(type(err).__name__, err, flush=True)
            sys.exit(1)
        print("admitted", flush=True)
        time.sleep(float(sys.argv[3]))  # (rank 0 serves the store meanwhile)
    """)
    env = {**os.environ, "PYTHONPATH": src}

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    procs = [start("0", "20", "8"), start("1", "20", "0")]
    try:
        assert procs[1].wait(timeout=30) == 0  # the job was admitted
        started = time.monotonic()
        late = start("1", "1.5", "0")
        procs.append(late)
        output = late.communicate(timeout=30)[0]
        took = time.monotonic() - started
    finally:
        for proc in procs:
            proc.kill()
    assert late.returncode == 1 and "was already admitted" in output, output
    assert "a duplicate" in output and took < 15, (took, output)
