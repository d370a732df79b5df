"""checkpoint.save / load right after an overlap-mode step whose comm hook runs on the default
process group (torch's ``fp16_compress_hook`` given ``dist.group.WORLD`` all-reduces on it, the
group of the checkpoint's exchanges; until stop 52 ``state=None`` meant WORLD too, now the
lane's own group).

The last bucket's hook may still be called on the progress thread after ``backward()`` and
``step()`` return. Before stop 52 save and load made their first exchange before finishing
that work, so the two threads' collectives reached WORLD in an order that could differ by
rank: one rank's all-gather met the other's all-reduce and both waited out the timeout in
the first exchange (a reported hang, 1 run in 4 under load; 3 of 6 here). The trigger below
makes that order certain: rank 1's hook starts its last all-reduce late, rank 0 enters the
save only after its own hook has started it.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import scaleout
from harness import run_ranks
from scaleout import checkpoint
from scaleout.pytorch import DataParallel, DistributedOptimizer

STEPS = 2


def body(folder: str, then_load: bool) -> list[float]:
    env = scaleout.init(timeout=5)
    torch.manual_seed(0)
    model = DataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
                         env.create_distribution(), verify_replicas=1)
    calls, last_started = [0], threading.Event()

    def late_fp16(state, bucket):  # the last step's hook: late on rank 1, flagged on rank 0
        calls[0] += 1
        last = calls[0] == STEPS  # (one bucket per step)
        if last and env.rank == 1:
            time.sleep(0.5)
        fut = default_hooks.fp16_compress_hook(state, bucket)
        if last:
            last_started.set()
        return fut

    model.register_comm_hook(torch.distributed.group.WORLD, late_fp16)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               mode="overlap")
    path = os.path.join(folder, "ckpt")
    for round_ in range(2 if then_load else 1):
        calls[0] = 0
        last_started.clear()
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * step + env.rank)
            F.cross_entropy(model(torch.randn(4, 8, generator=g)),
                            torch.randint(0, 2, (4,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        if env.rank == 0:
            assert last_started.wait(5)  # rank 0's all-reduce is on WORLD before its save
        if round_ == 0:
            if then_load:  # (the load's test: a save that cannot race)
                model.synchronize()
            checkpoint.save(path, model, opt, step=STEPS)
        else:
            assert checkpoint.load(path, model, opt)[0] == STEPS
    weights = [float(p.detach().sum()) for p in model.module.parameters()]
    model.close()
    env.finalize()
    return weights


def test_save_right_after_an_overlap_step_with_a_hook_on_the_default_group(tmp_path) -> None:
    results = run_ranks(2, body, str(tmp_path), False, timeout=30)
    assert results[0] == results[1]  # the last step's update landed alike, before the save


def test_load_right_after_an_overlap_step_with_a_hook_on_the_default_group(tmp_path) -> None:
    results = run_ranks(2, body, str(tmp_path), True, timeout=30)
    assert results[0] == results[1]
