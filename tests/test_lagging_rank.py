"""A rank that is alive but never reaches a collective (busy or blocked outside
communication) is named by the ranks whose wait for it times out (scaleout.core.progress,
scaleout.core.peer_waits.lagging): before, they said only that "a peer rank may have died"."""

from __future__ import annotations

import re

import torch

import scaleout
from harness import others_done, run_ranks
from scaleout.core import progress


def body_busy_rank(busy: int) -> str:
    env = scaleout.init(timeout=3)
    d = env.create_distribution()
    x = torch.ones(4)
    for _ in range(2):
        d.allreduce(x, group=scaleout.GroupType.GLOBAL).wait()
    if env.rank == busy:
        others_done()  # in Python, outside any collective; its heartbeat goes on
        return "busy"
    try:
        d.allreduce(x, group=scaleout.GroupType.GLOBAL).wait()
    except scaleout.CommunicationTimeout as err:
        return str(err)
    return "no error"


def test_the_rank_that_never_came_is_named() -> None:
    # the busy rank is rank 0, the store's host: the harness ends a rank with os._exit, so a
    # store host that timed out would take the store (and its heartbeats) with it at once
    # (scaleout's own exit keeps it up a little: test_watchdog_exits.py)
    said = run_ranks(3, body_busy_rank, 0, timeout=60)
    assert said[0] == "busy"
    for rank in (1, 2):
        message = said[rank]
        assert "did not complete within 3 s" in message, message
        assert "rank 0 is alive but not at this call" in message, message
        counts = re.search(r"this rank: (\d+), rank 0: (\d+) \(last: allreduce\); it is busy",
                           message)
        assert counts and int(counts[1]) == int(counts[2]) + 1, message  # one call behind
        assert f"rank {3 - rank} " not in message.split("call:")[1], message  # it came


def test_counts_are_per_group_label() -> None:
    progress.started("test[7, 8]", "allreduce", (7, 8))
    progress.started("test[7, 8]", "bcast", (7, 8))
    assert progress.count("test[7, 8]") == (2, (7, 8))
    assert progress.snapshot()["calls"]["test[7, 8]"] == [2, "bcast"]
    assert progress.snapshot()["latest"] == ["test[7, 8]", "bcast"]
    assert progress.count("test[9]") is None
    published = {7: {}, 8: {"calls": {"test[7, 8]": [1, "allreduce"]},
                            "latest": ["test[7, 8]", "allreduce"]}}
    assert progress.lagging("test[7, 8]", 7, published.get) == (
        "rank 8 is alive but not at this call: collectives started on this group by the last "
        "heartbeat: this rank: 2, rank 8: 1 (last: allreduce); it is busy or blocked outside "
        "scaleout's collectives, or waiting in another one")
    published[8]["latest"] = ["test[9, 8]", "alltoall"]  # it went on elsewhere
    assert "rank 8: 1 (last: allreduce), its latest call alltoall on group test[9, 8];" in \
        progress.lagging("test[7, 8]", 7, published.get)
    published[8]["calls"]["test[7, 8]"] = [2, "bcast"]
    assert progress.lagging("test[7, 8]", 7, published.get) is None
    assert progress.lagging("test[9]", 7, published.get) is None


def body_busy_rank_in_training() -> str:
    from torch import nn

    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=3)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model, mode="sync")
    for step in range(3):
        if env.rank == 0 and step == 2:  # (rank 0, the store's host: as above)
            others_done()
            return "busy"
        try:
            model(torch.ones(2, 4)).sum().backward()
        except scaleout.CommunicationTimeout as err:
            return str(err)
        opt.step()
        opt.zero_grad()
    return "no error"


def test_a_gradient_wait_names_the_rank_that_never_came() -> None:
    """Before stop 49 a bucket's wait was labelled by its lane's number ("lane 0"), not by
    its communicator's label, so a timed-out gradient wait named no lagging rank."""
    said = run_ranks(2, body_busy_rank_in_training, timeout=60)
    assert said[0] == "busy"
    assert "gradient communication of" in said[1] and "on group data-lane0[0, 1]" in said[1]
    assert "rank 0 is alive but not at this call" in said[1], said[1]
