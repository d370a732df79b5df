"""Ranks that took different code paths into calls the default checks do not compare (one
rank's call is new and checked, the other's was made before): the timeout names the rank at
another collective (before: ``a peer rank may have died, diverged, or called a different
operation``, naming nobody, e.g. a tensor-parallel forward given a batch of 5 on one rank and
of 4 on the other after a few steps)."""

from __future__ import annotations

import time

import torch

from harness import run_ranks
from scaleout.core import progress


def test_a_member_at_another_call_is_named() -> None:
    progress.started("astray[3, 4]", "allreduce", (3, 4))
    published = {4: {"calls": {"astray[3, 4]": [1, "allreduce (consistency check)"]},
                     "latest": ["astray[3, 4]", "allreduce (consistency check)"]}}
    said = progress.lagging("astray[3, 4]", 3, published.get)
    assert said is not None and said.startswith(
        "rank 4 is at another collective on this group: collectives started on it by the last "
        "heartbeat: this rank: 1 (last: allreduce), rank 4: 1 (last: allreduce (consistency "
        "check)); the ranks took different code paths"), said
    published[4]["calls"]["astray[3, 4]"] = [2, "bcast"]  # ahead: calls this rank did not make
    assert "rank 4: 2 (last: bcast)" in progress.lagging("astray[3, 4]", 3, published.get)
    published[4]["calls"]["astray[3, 4]"] = [1, "allreduce"]  # at this call: nothing to say
    assert progress.lagging("astray[3, 4]", 3, published.get) is None


def body_new_call_meets_a_repeated_one() -> tuple[str, float, str]:
    import scaleout

    env = scaleout.init(timeout=3)
    d = env.create_distribution()
    d.allreduce(torch.ones(4, 8), group=scaleout.GroupType.DATA).wait()
    shape = (5, 8) if env.rank == 1 else (4, 8)  # rank 1 alone took another path
    started = time.monotonic()
    try:
        d.allreduce(torch.ones(shape), group=scaleout.GroupType.DATA).wait()
    except scaleout.CommunicationError as err:
        return type(err).__name__, time.monotonic() - started, str(err)
    return "no error", 0.0, ""


def test_a_rank_on_another_path_is_named_in_the_timeout() -> None:
    kind, seconds, message = run_ranks(2, body_new_call_meets_a_repeated_one, timeout=40)[0]
    assert kind == "CommunicationTimeout", (kind, message)
    assert "rank 1 is at another collective on this group" in message, message
    assert "(last: allreduce (consistency check))" in message, message
    assert seconds < 8, message
