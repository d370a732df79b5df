"""Lifecycle bug hunt, third round (stop 52): the reach and the safety of collecting a
DataParallel dropped without close() (``dp_lifetime``). The first test failed on the code
before it; the others guard the finalizer's safety (they passed before it too)."""

from __future__ import annotations

import gc
import os
import weakref

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer


def _counts() -> tuple[int, int, int]:
    """(threads, descriptors, process groups) of this process."""
    return (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")),
            len(c10d._world.pg_map))


def _trained(env: scaleout.Environment, steps: int = 2, **options: object) -> tuple:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = DataParallel(net, env.create_distribution(), **options)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def drop_tuned_models(trials: int) -> tuple[list[tuple[int, int, int]], int]:
    """A model tuned by ``tune=True`` per trial (each on a distribution of its own), dropped
    without close(): counts after each trial, and how many models are still alive."""
    env = scaleout.init(timeout=30)
    seen, refs = [], []
    for _ in range(trials):
        model, opt = _trained(env, steps=10, tune=True)
        model.synchronize()
        assert model.tuning is not None  # (it re-planned: the old plan's lanes handed back)
        refs.append(weakref.ref(model))
        del model, opt
        gc.collect()
        seen.append(_counts())
    env.finalize()
    return seen, sum(ref() is not None for ref in refs)


def test_dropped_tuned_models_leave_no_spare_lanes() -> None:
    # before: the old plan's lanes the tuned plan did not take stayed in the dropped
    # distribution's spare pool: 8 trials, 2 ranks: +1 process group, +1 descriptor and
    # +2 threads per trial in every rank
    for seen, alive in run_ranks(2, drop_tuned_models, 8, timeout=120):
        (threads, fds, groups), (threads0, fds0, groups0) = seen[-1], seen[1]
        assert alive == 0, seen
        assert groups == groups0 and threads <= threads0 + 3 and fds <= fds0 + 2, seen


def collected_at_awkward_points() -> list[bool]:
    """A dropped model collected after finalize(), and one collected inside finalize()'s
    destroy_process_group() (after torch shut its groups down, before it forgot them):
    neither raises nor hangs, and init() meets again afterwards."""
    env = scaleout.init(timeout=20)
    model, opt = _trained(env)
    env.finalize()
    ref_after = weakref.ref(model)
    del model, opt
    gc.collect()
    env = scaleout.init(timeout=20)
    model, opt = _trained(env)  # (in flight: overlap mode, no synchronize())
    ref_inside = weakref.ref(model)
    cycle: list = [model]
    cycle.append(cycle)  # (collected by the collector only)
    del model, opt, cycle
    original = c10d._update_default_pg

    def collecting(pg: object) -> None:
        gc.collect()
        original(pg)
    c10d._update_default_pg = collecting
    gc.disable()
    try:
        env.finalize()
    finally:
        c10d._update_default_pg = original
        gc.enable()
    env = scaleout.init(timeout=20)
    model, _ = _trained(env)
    model.close()
    env.finalize()
    return [ref_after() is None, ref_inside() is None, not tdist.is_initialized()]


def test_models_collected_after_or_inside_finalize_do_no_harm() -> None:
    for seen in run_ranks(2, collected_at_awkward_points, timeout=60):
        assert seen == [True, True, True], seen
