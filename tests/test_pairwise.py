"""All-to-all and all-gather as receive-first point-to-point exchanges over gloo
(scaleout.core.pairwise): the same results as the collectives they replace, the path really
taken, and a peer that never comes is a timeout, not a silent success."""

from __future__ import annotations

import os
import time

import pytest
import torch

import scaleout
from harness import others_done, run_ranks
from scaleout.core import collectives, pairwise
from test_collectives import body_all_groups

OPS = ["allgather", "allgatherv", "alltoall", "alltoallv", "reduce_scatter"]
#: rows of 16 float32 values: a block twice the exchange's threshold
LARGE_ROWS = pairwise.MIN_BLOCK_BYTES // (16 * 4) * 2


@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 3, 1), (3, 1, 1)],
                         ids=lambda g: f"w{g[0]}-d{g[1]}xm{g[2]}")
def test_small_blocks_through_the_exchange_match_the_oracle(
        grid: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block goes through the exchange (threshold 0: the ranks are forked from here);
    every collective of OPS, one after the other in the same job."""
    monkeypatch.setattr(pairwise, "MIN_BLOCK_BYTES", 0)
    world, data_parts, model_parts = grid
    run_ranks(world, body_all_groups, OPS, data_parts, model_parts, timeout=90)


def body_large_blocks() -> list[bool]:
    env = scaleout.init(timeout=60)
    d = env.create_distribution()
    comm = d.communicator(scaleout.GroupType.DATA)
    rows = pairwise.MIN_BLOCK_BYTES // 4  # one block of exactly the threshold per peer
    x = torch.arange(2 * rows, dtype=torch.float32) + 1000 * env.rank
    taken = [pairwise.recv_first(comm.group, x, rows * 4, ranks=2),
             pairwise.recv_first(comm.group, x, rows * 4 - 1, ranks=2),
             pairwise.recv_first(comm.group, x, rows * 4, ranks=3, gather=True)]
    out = d.alltoall(x, group=scaleout.GroupType.DATA).wait()
    peer = 1 - env.rank
    want = torch.cat([torch.arange(rows) + rows * env.rank + 1000 * r for r in (0, 1)]).float()
    assert torch.equal(out, want), (out[:4], want[:4], peer)
    gathered = d.allgather(x[:rows], group=scaleout.GroupType.DATA).wait()
    assert torch.equal(gathered, torch.cat([torch.arange(rows) + 1000 * r for r in (0, 1)]).float())
    collectives.reduce_scatter_single = None  # gloo's reduce-scatter must not be called
    summed = d.reduce_scatter(x, group=scaleout.GroupType.DATA).wait()
    assert torch.equal(summed, 2 * (torch.arange(rows) + rows * env.rank).float() + 1000)
    env.finalize()
    return taken


def test_blocks_from_the_threshold_up_take_the_exchange() -> None:
    taken = run_ranks(2, body_large_blocks, timeout=90)
    assert taken == [[True, False, False]] * 2


def body_waited_twice() -> None:
    env = scaleout.init(timeout=20)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    rows = pairwise.MIN_BLOCK_BYTES // 4
    x = torch.arange(2 * rows, dtype=torch.float32) + 1000 * env.rank
    for _ in range(3):  # a request timed on completion (a future's thread) and waited for
        request = collectives.alltoallv(comm, x, [rows, rows], [rows, rows])
        done = []
        request.when_done(lambda _: done.append(time.monotonic()))
        began = time.monotonic()
        out = request.wait()
        assert time.monotonic() - began < 10, "the second waiter blocked until its timeout"
        assert torch.equal(out[rows * (1 - env.rank): rows * (2 - env.rank)],
                           x[rows * env.rank: rows * (env.rank + 1)] + 1000 * (1 - 2 * env.rank))
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done, "the completion callback never ran"
    env.finalize()


def test_an_exchange_waited_by_two_threads_completes_for_both() -> None:
    # gloo's point-to-point works hand each completion to one wait: with a future's thread
    # and the training loop both waiting, one of them hung until its timeout (the sharded
    # tables' exchanges with blocks >= MIN_BLOCK_BYTES: a hybrid DLRM at batch 8192)
    run_ranks(2, body_waited_twice, timeout=60)


def body_peer_never_comes() -> str:
    env = scaleout.init(timeout=2)
    d = env.create_distribution()
    if env.rank == 1:
        others_done()  # never calls the alltoall (no finalize: the peers disagree by design)
        return "slept"
    began = time.monotonic()
    try:
        d.alltoall(torch.ones(2 * pairwise.MIN_BLOCK_BYTES // 4),
                   group=scaleout.GroupType.DATA).wait()
    except scaleout.CommunicationTimeout as err:
        assert time.monotonic() - began < 3.5
        return str(err)
    return "no error"


def test_a_missing_peer_is_a_timeout_not_a_result() -> None:
    message = run_ranks(2, body_peer_never_comes, timeout=60)[0]
    assert "alltoall" in message and "did not complete within 2 s" in message, message


def test_recv_first_is_off_for_gpu_tensors_and_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.ones(4)
    assert not pairwise.recv_first(None, cpu, 1 << 30, ranks=2)  # not a process group
    monkeypatch.setenv(pairwise.ENV_VAR, "0")
    assert not pairwise.recv_first(None, cpu, 1 << 30, ranks=2)
    with pytest.raises(ValueError, match="expected 2 send and receive blocks"):
        pairwise.exchange_blocks(None, [0, 1], 0, [cpu], [cpu, cpu], 1.0)


def body_uneven_alltoallv(rows: int) -> bool:
    """Counts where the ranks see different largest blocks: C[i][j] rows from i to j, the
    one large block from rank 0 to rank 1 (and, at 2 ranks, rank 1 sending nothing)."""
    env = scaleout.init(timeout=20)
    d = env.create_distribution()
    world, me = env.world_size, env.rank
    counts = [[0 if world == 2 else 1] * world for _ in range(world)]
    counts[0][1] = rows
    if world == 2:
        counts[1][0] = 0
    send_counts = counts[me]
    recv_counts = [counts[i][me] for i in range(world)]
    width = 16
    x = torch.cat([torch.full((counts[me][j], width), float(100 * me + j)) for j in range(world)])
    out = d.alltoallv(x, send_counts, recv_counts, group=scaleout.GroupType.DATA).wait()
    want = torch.cat([torch.full((counts[i][me], width), float(100 * i + me))
                      for i in range(world)])
    env.finalize()
    return bool(torch.equal(out, want))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_on_the_path_when_their_alltoallv_blocks_differ(world: int) -> None:
    """The exchange or gloo's collective is chosen alike on every rank, whatever blocks each
    one sends or receives (a rank that sends no rows, a third rank with only small blocks);
    otherwise some ranks post messages the others never match and the call times out."""
    assert run_ranks(world, body_uneven_alltoallv, LARGE_ROWS, timeout=60) == [True] * world


def body_allgatherv_one_rank_empty(rows: int) -> bool:
    env = scaleout.init(timeout=20)
    d = env.create_distribution()
    counts = [0, rows]  # rank 0 contributes no rows, rank 1 a block above the threshold
    x = torch.full((counts[env.rank], 16), float(env.rank + 1))
    out = d.allgatherv(x, counts, group=scaleout.GroupType.DATA).wait()
    env.finalize()
    return bool(torch.equal(out, torch.full((rows, 16), 2.0)))


def test_a_rank_with_no_rows_takes_the_same_allgatherv_path() -> None:
    assert run_ranks(2, body_allgatherv_one_rank_empty, LARGE_ROWS, timeout=60) == [True, True]


def body_setting_differs() -> str:
    env = scaleout.init(timeout=20)
    d = env.create_distribution()
    os.environ[pairwise.ENV_VAR] = "0" if env.rank == 1 else "1"  # as a launch that lost it
    x = torch.zeros(2 * pairwise.MIN_BLOCK_BYTES // 4)
    with pytest.raises(ValueError, match="recv_first=off") as caught:
        d.alltoall(x, group=scaleout.GroupType.DATA).wait()
    env.finalize()
    return str(caught.value)


def test_ranks_with_different_exchange_settings_get_an_error_not_a_hang() -> None:
    for message in run_ranks(2, body_setting_differs, timeout=60):
        assert "recv_first=on" in message and "recv_first=off" in message, message


def body_polled() -> bool:
    env = scaleout.init(timeout=20)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    rows = pairwise.MIN_BLOCK_BYTES // 4
    x = torch.arange(2 * rows, dtype=torch.float32) + 1000 * env.rank
    request = collectives.alltoall(comm, x)  # through the exchange (blocks at the threshold)
    deadline = time.monotonic() + 10
    while not request.test() and time.monotonic() < deadline:
        time.sleep(0.001)
    done = request.test()
    if done:  # (else the ranks would leave the exchange in flight: wait it out)
        peer = 1 - env.rank
        assert torch.equal(request.wait()[rows * peer: rows * (peer + 1)],
                           x[rows * env.rank: rows * (env.rank + 1)] + 1000 * (peer - env.rank))
    else:
        request.wait()
    env.finalize()
    return done


def test_an_exchange_only_polled_with_test_completes() -> None:
    """Only the waiter thread completes the point-to-point works: polling must start it."""
    assert run_ranks(2, body_polled, timeout=60) == [True, True]
