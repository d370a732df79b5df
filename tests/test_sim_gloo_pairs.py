"""Gloo's recv-ready protocol as a fluid model (sim/gloo_pairs.py): timelines worked out by
hand for two ranks exchanging, the programs of gloo's all-to-all and all-gather, and the
start skew the bench's barrier leaves."""

from __future__ import annotations

import pytest

from scaleout.sim.gloo_pairs import (
    Post,
    allgather_program,
    alltoall_program,
    call_time,
    exchange_program,
    run,
)

B = 1e8  # bytes/s per direction
L = 1e-4  # one message's latency
N = 8e6  # bytes each way


def _exchange(first: str) -> list[Post]:
    posts = {"send": Post("send", 1, N), "recv": Post("recv", 1, N)}
    order = [posts[first], posts["recv" if first == "send" else "send"]]
    return order + [Post("wait_send"), Post("wait_recv"), Post("end")]


def _swap_peer(program: list[Post]) -> list[Post]:
    return [Post(p.kind, 0, p.nbytes, p.slot) if p.peer == 1 else p for p in program]


def test_recv_first_exchanges_both_ways_at_once() -> None:
    # rank 1 starts 2L late; rank 0's recv-ready reaches it at L, its own is sent first
    ends = run([_exchange("recv"), _swap_peer(_exchange("recv"))], bandwidth=B, latency=L,
               starts=[0.0, 2 * L])
    # rank 0's data leaves when rank 1's recv-ready arrives (3L), arrives at 3L + N/B + L
    assert ends[1][0] == pytest.approx(4 * L + N / B)
    assert ends[0][0] == pytest.approx(3 * L + N / B)  # rank 1's data left at 2L


def test_send_first_on_a_late_rank_serialises_the_pair() -> None:
    ends = run([_exchange("send"), _swap_peer(_exchange("send"))], bandwidth=B, latency=L,
               starts=[0.0, 2 * L])
    # rank 1 finds rank 0's recv-ready and sends at 2L; its own recv-ready leaves after its
    # data (2L + N/B), reaches rank 0 at 3L + N/B; rank 0's data then takes N/B more
    assert ends[0][0] == pytest.approx(3 * L + 2 * N / B)
    assert ends[1][0] == pytest.approx(4 * L + 2 * N / B)


def test_in_step_ranks_exchange_at_once_even_send_first() -> None:
    ends = run([_exchange("send"), _swap_peer(_exchange("send"))], bandwidth=B, latency=L)
    assert max(e[0] for e in ends) == pytest.approx(2 * L + N / B)


def test_gloo_programs_post_in_the_sources_order() -> None:
    assert [(p.kind, p.peer) for p in alltoall_program(0, 3, 3.0)[:4]] == [
        ("send", 1), ("recv", 2), ("send", 2), ("recv", 1)]
    ring = allgather_program(1, 3, 6.0)
    assert [(p.kind, p.peer, p.nbytes) for p in ring[:4]] == [
        ("send", 2, 1.0), ("recv", 0, 1.0), ("send", 2, 1.0), ("recv", 0, 1.0)]
    assert ring[4].kind == "wait_send" and ring[-1].kind == "end"


def test_call_times_two_and_three_ranks() -> None:
    n = 2 * N
    # 2 ranks: all-to-all's halves one after the other; all-gather's four quarters in three
    # slots (the late rank's first quarter alone, then one each way, then the other's last)
    assert call_time("alltoall", 2, n, bandwidth=B, latency=L) == pytest.approx(n / B, rel=1e-2)
    assert call_time("allgather", 2, n, bandwidth=B, latency=L) == pytest.approx(
        0.75 * n / B, rel=1e-2)
    # 3 ranks: the ring all-gather uses different pairs each way: the textbook ring
    assert call_time("allgather", 3, n, bandwidth=B, latency=L) == pytest.approx(
        2 / 3 * n / B, rel=1e-2)
    # more bandwidth is never slower
    assert call_time("alltoall", 3, n, bandwidth=2 * B, latency=L) < call_time(
        "alltoall", 3, n, bandwidth=B, latency=L)


def test_any_skew_beyond_one_latency_gives_the_same_steady_time() -> None:
    def steady(starts: list[float]) -> float:  # per call, after the first two
        programs = [[p for c in range(5) for p in alltoall_program(r, 3, 3 * N, c)]
                    for r in range(3)]
        ends = run(programs, bandwidth=B, latency=L, starts=starts)
        return max(e[-1] - e[1] for e in ends) / 3

    times = [steady(s) for s in ([0, L, L], [2 * L, 0, 5 * L], [0, 30 * L, 10 * L], [0, L, 0])]
    assert max(times) == pytest.approx(min(times), rel=1e-3)
    # 3 ranks: each pair's exchange waits for one direction, 1.5x the textbook 2N/B
    assert min(times) == pytest.approx(1.5 * 2 * N / B, rel=1e-2)


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="op must be one of"):
        call_time("allreduce", 2, N, bandwidth=B, latency=L)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        call_time("alltoall", 1, N, bandwidth=B, latency=L)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        run([[Post("end")]], bandwidth=0, latency=L)
    with pytest.raises(ValueError, match="deadlock"):
        run([[Post("recv", 1, N), Post("wait_recv")], [Post("end")]], bandwidth=B, latency=L)
    with pytest.raises(ValueError, match="step kind"):
        Post("jump")
    with pytest.raises(ValueError, match="one start per rank"):
        run([[Post("end")]], bandwidth=B, latency=L, starts=[0.0, 1.0])
    with pytest.raises(ValueError, match="among the other"):
        run([[Post("send", 0, N)]], bandwidth=B, latency=L)


@pytest.mark.parametrize("ranks", [2, 3])
def test_scaleouts_exchange_runs_every_pair_both_ways_at_once(ranks: int) -> None:
    # scaleout's receive-first exchange (core/pairwise.py): every recv-ready leaves before any
    # data, so with a late rank each rank's p-1 blocks of n/p share its egress at once: the
    # textbook (p-1)/p n / B, where gloo's own all-to-all at 2 ranks takes twice that
    n = 3 * N
    exchange = call_time("exchange", ranks, n, bandwidth=B, latency=L)
    assert exchange == pytest.approx((ranks - 1) / ranks * n / B, rel=2e-2)
    if ranks == 2:
        assert call_time("alltoall", 2, n, bandwidth=B, latency=L) == pytest.approx(
            2 * exchange, rel=2e-2)
    program = exchange_program(0, ranks, n)
    kinds = [post.kind for post in program]
    assert kinds[:2 * (ranks - 1)] == ["recv"] * (ranks - 1) + ["send"] * (ranks - 1)
    assert {post.nbytes for post in program if post.kind == "send"} == {n / ranks}
