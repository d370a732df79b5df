"""Ranks that run different numbers of steps: the longer rank waits in a collective that the
others, already in finalize(), never start. Before stop 51 both sides sat out the whole timeout
(the digits example at 3 ranks, whose shards differ by a sample: 300 s); now every rank raises
PeerFailedError naming the waiting rank and the counts, within seconds
(``scaleout.core.diverged``)."""

from __future__ import annotations

import time

import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.core.grid import GroupType
from scaleout.core.errors import PeerFailedError
from scaleout.pytorch import DataParallel, DistributedOptimizer

TIMEOUT = 60.0  # the collectives' timeout: a divergence must be named long before it


def extra_step(long_rank: int) -> tuple[str, float]:
    """DataParallel training where ``long_rank`` runs one step more than the others, which
    then close the model and finalize; (what ended it, seconds from the last step)."""
    env = scaleout.init(timeout=TIMEOUT)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    for _ in range(3 + (env.rank == long_rank)):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    began = time.monotonic()
    try:
        model.synchronize()  # (the long rank: its last step's gradients never come)
        model.close()
        env.finalize()
    except PeerFailedError as err:
        return str(err), time.monotonic() - began
    return "finished", time.monotonic() - began


def extra_allreduce() -> tuple[str, float]:
    """Rank 1 makes one all-reduce more than rank 0, which finalizes."""
    env = scaleout.init(timeout=TIMEOUT)
    dist = env.create_distribution()
    began = time.monotonic()
    try:
        for _ in range(2 + env.rank):
            dist.allreduce(torch.ones(3), group=GroupType.DATA).wait()
        env.finalize()
    except PeerFailedError as err:
        return str(err), time.monotonic() - began
    return "finished", time.monotonic() - began


def test_a_rank_with_an_extra_step_is_named_on_every_rank_within_seconds() -> None:
    results = run_ranks(3, extra_step, 2, timeout=TIMEOUT + 30)
    for rank, (said, seconds) in enumerate(results):
        assert "rank 2 waits in gradient communication" in said, (rank, said)
        assert "will never start" in said and "in finalize()" in said, (rank, said)
        assert seconds < 20, (rank, seconds, said)
    assert "ranks 0, 1 will never start" in results[2][0], results[2][0]


def test_an_extra_collective_is_named_on_both_ranks() -> None:
    results = run_ranks(2, extra_allreduce, timeout=TIMEOUT + 30)
    for rank, (said, seconds) in enumerate(results):
        assert "rank 1 waits in allreduce on group data[0, 1]" in said, said
        assert "rank 0 will never start: it is in finalize() (rank 0 after" in said, said
        assert seconds < 20, (rank, seconds, said)
