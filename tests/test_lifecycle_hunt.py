"""Lifecycle bug hunt (stop 52): what a sweep of models, and a rank whose backward raised,
leave behind. Each test failed on the code before it."""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as tdist
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.core.errors import PeerFailedError
from scaleout.pytorch import DataParallel, DistributedOptimizer


def _resources() -> tuple[int, int, int]:
    """(threads, file descriptors, torch process groups) of this process."""
    return (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")),
            len(tdist.distributed_c10d._world.pg_map))


def sweep(trials: int) -> list[tuple[int, int, int]]:
    """Build, train and close a model per trial; the resources after each."""
    env = scaleout.init(timeout=20)
    seen = []
    for _ in range(trials):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model = DataParallel(net, env.create_distribution())
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
        for _ in range(2):
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        model.close()
        del model, opt, net
        gc.collect()  # (the model is a cycle: its groups go with it)
        seen.append(_resources())
    env.finalize()
    return seen


def test_a_sweep_of_closed_models_keeps_threads_descriptors_and_groups_flat() -> None:
    # before: every closed model kept its lane's process group: +1 socket, +2 gloo threads
    # (so 8 more of each from the 2nd to the 10th trial); threads and descriptors come and go
    # by one or two meanwhile (torch's and the heartbeat's own), groups do not
    for seen in run_ranks(2, sweep, 10, timeout=90):
        (threads, fds, groups), (threads0, fds0, groups0) = seen[-1], seen[1]
        assert groups == groups0 and fds <= fds0 + 2 and threads <= threads0 + 3, seen


def raise_in_backward() -> tuple[str, object, float]:
    """Rank 1's gradient hook raises at its 3rd backward; the loop skips the batch as an
    out-of-memory retry does. What ended each rank, and when."""
    env = scaleout.init(timeout=10)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return grad

    if env.rank == 1:
        net[0].weight.register_hook(hook)
    began = time.monotonic()
    try:
        for _ in range(8):
            try:
                model(torch.randn(5, 4)).sum().backward()
                opt.step()
            except RuntimeError as err:
                if "out of memory" not in str(err):
                    raise
            opt.zero_grad()
        model.synchronize()
    except PeerFailedError as err:
        return str(err), err.failed_rank, time.monotonic() - began
    except RuntimeError as err:
        return str(err), env.rank, time.monotonic() - began
    return "finished", None, time.monotonic() - began


def test_an_exception_inside_one_ranks_backward_is_named_on_every_rank() -> None:
    # before: rank 1 trained its next steps without exchanging a gradient (its backwards
    # never ended) while rank 0 waited; the job was named only at the end of the loop
    (text0, failed0, took0), (text1, failed1, took1) = run_ranks(2, raise_in_backward,
                                                                 timeout=40)
    assert "rank 1: the last backward through DataParallel stopped part-way" in text1, text1
    assert failed1 == 1 and took1 < 5.0
    assert failed0 == 1 and "rank 1 failed" in text0, text0
    assert took0 < 8.0, took0
