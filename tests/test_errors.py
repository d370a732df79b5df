"""Bad input gives a clear ValueError/TypeError; a wait never hangs; misuse is named."""

from __future__ import annotations

import time

import pytest
import torch

import scaleout
from harness import RankFailure, others_done, run_ranks
from scaleout import CommunicationTimeout, GroupType, NotInitializedError, ReduceOp, ScaleoutError

G = GroupType.DATA


def expect(exc: type[BaseException], fragment: str, call) -> None:
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def body_bad_arguments() -> None:
    env = scaleout.init(timeout=20)
    d = env.create_distribution()
    x = torch.ones(4)
    expect(TypeError, "expected a torch.Tensor, got list", lambda: d.allreduce([1, 2], group=G))
    expect(TypeError, "dtype torch.complex64 is not supported",
           lambda: d.allreduce(torch.ones(2, dtype=torch.complex64), group=G))
    expect(TypeError, "op must be a scaleout.ReduceOp", lambda: d.allreduce(x, "sum", group=G))
    expect(TypeError, "AVG needs a floating dtype",
           lambda: d.allreduce(torch.ones(2, dtype=torch.int64), ReduceOp.AVG, group=G))
    expect(TypeError, "group must be a scaleout.GroupType", lambda: d.allreduce(x, group="data"))
    expect(ValueError, "root must be a rank of group data[0, 1] (0..1), got 2",
           lambda: d.bcast(x, 2, group=G))
    expect(TypeError, "root must be an int rank", lambda: d.reduce(x, 0.0, group=G))
    expect(ValueError, "counts must have one entry per rank of the group (2), got 3",
           lambda: d.allgatherv(x, [4, 4, 4], group=G))
    expect(ValueError, "must pass counts[",
           lambda: d.allgatherv(x, [3, 3], group=G))
    expect(ValueError, "counts must be >= 0", lambda: d.allgatherv(x, [-1, 4], group=G))
    expect(ValueError, "dim 0 must be a multiple of the group size 2",
           lambda: d.reduce_scatter(torch.ones(3), group=G))
    expect(ValueError, "dim 0 must be a multiple of the group size 2",
           lambda: d.scatter(torch.ones(5, 2), 0, group=G))
    expect(ValueError, "must have sum(send_counts) = 5 rows",
           lambda: d.alltoallv(x, [2, 3], [2, 2], group=G))
    expect(ValueError, "timeout must be > 0", lambda: d.allreduce(x, group=G).wait(timeout=0))
    # after all those refusals the group still works
    assert torch.equal(d.allreduce(torch.ones(3), group=G).wait(), torch.full((3,), 2.0))
    env.finalize()


def test_bad_arguments_are_refused_without_hanging() -> None:
    run_ranks(2, body_bad_arguments, timeout=60)


def body_timeout() -> tuple[str, float]:
    env = scaleout.init(timeout=30, check_consistency="off")  # the check would wait first
    d = env.create_distribution()
    if env.rank == 0:
        started = time.monotonic()
        with pytest.raises(CommunicationTimeout) as info:
            d.allreduce(torch.ones(8), group=G).wait(timeout=1.0)
        return str(info.value), time.monotonic() - started
    others_done()  # rank 1 never joins this allreduce
    return "", 0.0


def test_wait_times_out_naming_rank_group_and_operation() -> None:
    message, waited = run_ranks(2, body_timeout, timeout=60)[0]
    assert "rank 0: allreduce on group data[0, 1] did not complete within 1 s" in message
    assert waited < 10


def body_mismatch() -> None:
    env = scaleout.init(timeout=20, check_consistency=True)
    d = env.create_distribution()
    shape = (4,) if env.rank == 0 else (5,)
    with pytest.raises(ValueError, match=r"rank 0: allreduce\(float32, shape \(4,\), SUM\); "
                                          r"rank 1: allreduce\(float32, shape \(5,\), SUM\)"):
        d.allreduce(torch.ones(shape), group=G)
    other = d.bcast if env.rank == 0 else d.reduce
    with pytest.raises(ValueError, match=r"rank 0: bcast\(float32, shape \(4,\), 0\); "
                                          r"rank 1: reduce\(float32, shape \(4,\), SUM, 0\)"):
        other(torch.ones(4), 0, group=G)
    op = ReduceOp.SUM if env.rank == 0 else ReduceOp.MAX
    with pytest.raises(ValueError, match=r"rank 0: allreduce.*SUM\); rank 1: allreduce.*MAX\)"):
        d.allreduce(torch.ones(4), op, group=G)
    dtype = torch.float32 if env.rank == 0 else torch.float64
    with pytest.raises(ValueError, match="rank 1: allreduce\\(float64"):
        d.allreduce(torch.ones(4, dtype=dtype), group=G)
    with pytest.raises(ValueError, match="rank 0: barrier\\(\\); rank 1: allreduce"):
        d.barrier(group=G) if env.rank == 0 else d.allreduce(torch.ones(4), group=G)
    from scaleout.core.collectives import verify_plan
    verify_plan(d.communicator(G), "bucket plan", [(4, "float32"), (8, "float32")])
    with pytest.raises(ValueError, match=r"rank 0: bucket plan \[4\]; rank 1: bucket plan \[5\]"):
        verify_plan(d.communicator(G), "bucket plan", [4 + env.rank])
    # alltoallv counts that do not match across the ranks: one row of uninitialised memory
    send, recv = ([2, 2], [3, 2]) if env.rank == 1 else ([2, 2], [2, 2])
    with pytest.raises(ValueError, match="group rank 0 sends 2 rows to group rank 1, which "
                                         "expects 3"):
        d.alltoallv(torch.ones(4), send, recv, group=G)
    # ranks on different grids would each run their group's collectives alone
    with pytest.raises(ValueError, match=r"rank 0: create_distribution Grid\(world_size=2, "
                       r"data_parts=2, model_parts=1\); rank 1: create_distribution Grid\(\S+ "
                       r"data_parts=1, model_parts=2\)"):
        env.create_distribution(*((2, 1) if env.rank == 0 else (1, 2)))
    assert torch.equal(d.allreduce(torch.ones(2), group=G).wait(), torch.full((2,), 2.0))
    env.finalize()


def test_consistency_check_reports_mismatched_calls() -> None:
    run_ranks(2, body_mismatch, timeout=60)


def body_lifecycle() -> None:
    env = scaleout.init(timeout=20)
    with pytest.raises(ScaleoutError, match="called twice"):
        scaleout.init()
    d = env.create_distribution()
    with pytest.raises(ValueError, match="must divide the world size 3"):
        env.create_distribution(2, 1)
    with pytest.raises(ValueError, match="model_parts must be >= 1"):
        env.create_distribution(1, 0)
    with pytest.raises(ValueError, match="model_parts must be >= 1, got 0"):  # not data_parts
        env.create_distribution(None, 0)
    env.finalize()
    with pytest.raises(NotInitializedError, match="finalized"):
        d.allreduce(torch.ones(1), group=G)
    with pytest.raises(NotInitializedError):
        env.create_distribution()
    with pytest.raises(NotInitializedError):
        env.finalize()


def test_lifecycle_errors() -> None:
    run_ranks(3, body_lifecycle, timeout=60)


def body_raise() -> None:
    env = scaleout.init(timeout=20)
    if env.rank == 1:
        raise KeyError("boom on purpose")
    env.finalize()


def test_harness_reports_failing_rank() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 -----.*KeyError: 'boom on purpose'"):
        run_ranks(2, body_raise, timeout=30)


def test_bad_init_arguments() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        scaleout.init(backend="tcp")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        scaleout.init(timeout=-1)
    with pytest.raises(TypeError, match="timeout must be seconds"):
        scaleout.init(timeout="5")


def body_first_call_check() -> None:
    env = scaleout.init(timeout=20, check_consistency="first")
    d = env.create_distribution()
    for _ in range(3):  # checked once, then remembered
        d.allreduce(torch.ones(4), group=G).wait()
    assert d.communicator(G)._seen == {"allreduce(float32, shape (4,), SUM)"}
    with pytest.raises(ValueError, match=r"rank 0: allreduce\(float32, shape \(6,\), SUM\); "
                                          r"rank 1: allreduce\(float32, shape \(7,\), SUM\)"):
        d.allreduce(torch.ones(6 + env.rank), group=G)
    env.finalize()


def test_first_call_check_catches_a_new_mismatch() -> None:
    run_ranks(2, body_first_call_check, timeout=60)


def body_default_settings_catch_the_issue_cases() -> None:
    env = scaleout.init(timeout=20)  # default: "first"
    d = env.create_distribution()
    with pytest.raises(ValueError, match=r"rank 0: allreduce\(float32, shape \(4,\), SUM\); "
                                          r"rank 1: allreduce\(float32, shape \(5,\), SUM\)"):
        d.allreduce(torch.ones(4 + env.rank), group=G)
    with pytest.raises(ValueError, match=r"rank 0: allreduce\(float32, shape \(3,\), SUM\); "
                                          r"rank 1: allreduce\(float32, shape \(3,\), MAX\)"):
        d.allreduce(torch.ones(3), ReduceOp.SUM if env.rank == 0 else ReduceOp.MAX, group=G)
    with pytest.raises(ValueError, match=r"rank 0: allreduce\(float32, shape \(2,\), SUM\); "
                                          r"rank 1: bcast\(float32, shape \(2,\), 0\)"):
        d.allreduce(torch.ones(2), group=G) if env.rank == 0 else d.bcast(torch.ones(2), 0, group=G)
    assert torch.equal(d.allreduce(torch.ones(2), group=G).wait(), torch.full((2,), 2.0))
    env.finalize()


def test_default_settings_catch_mismatched_calls() -> None:
    run_ranks(2, body_default_settings_catch_the_issue_cases, timeout=60)


def body_one_rank_refuses(mode: str) -> list[str]:
    """Rank 1 alone passes arguments its call refuses; rank 0's call is fine."""
    env = scaleout.init(timeout=20, check_consistency=mode)
    d = env.create_distribution()
    bad, x = env.rank == 1, torch.ones(4)
    calls = [  # (rank 1's refusal; "first" mode: each call new on the communicator)
        lambda: d.allgatherv(torch.ones(3) if bad else x, [4, 4], group=G),
        lambda: d.allgather(x, out=torch.empty(7 if bad else 8), group=G),
        lambda: d.alltoall(x, out=x if bad else torch.empty(4), group=G),
        lambda: d.scatter(x, 0, out=torch.empty(3 if bad else 2), group=G),
    ]
    if mode == "full":  # (arguments that every rank's description holds: "full" only)
        calls += [lambda: d.bcast(x, 5 if bad else 0, group=G),
                  lambda: d.allreduce([1.0] if bad else x, group=G),
                  lambda: d.reduce(x, 0, "sum" if bad else ReduceOp.SUM, group=G)]
    said = []
    for call in calls:
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        said.append(f"{type(info.value).__name__}: {info.value}")
    # nobody waits in a call the other never started: the group still works
    assert torch.equal(d.allreduce(torch.ones(2), group=G).wait(), torch.full((2,), 2.0))
    env.finalize()
    return said


@pytest.mark.parametrize("mode", ["first", "full"])
def test_arguments_one_rank_alone_refuses_are_named_on_the_others(mode: str) -> None:
    """Before stop 49 the refusing rank raised after the call's consistency exchange, the
    others waited in the collective itself until their timeout, and the refusing rank's next
    call met theirs in gloo (an abort)."""
    ok, refused = run_ranks(2, body_one_rank_refuses, mode, timeout=90)
    assert len(ok) == len(refused) == (4 if mode == "first" else 7)
    for mine, theirs in zip(refused, ok):
        assert theirs.startswith("ValueError: rank 0: ") and \
            "rank 1 refused the call's arguments: rank 0: " in theirs, theirs
        assert mine.split(": ", 1)[1] in theirs, (mine, theirs)  # rank 1's own error, named
    assert refused[0].startswith("ValueError: allgatherv: this rank (group rank 1) must pass")
    if mode == "full":
        assert refused[5] == "TypeError: allreduce: expected a torch.Tensor, got list"


def body_refused_after_a_known_call() -> str:
    env = scaleout.init(timeout=2, check_consistency="first")
    d = env.create_distribution()
    x = torch.ones(4)
    d.allgatherv(x, [4, 4], group=G).wait()  # known: "first" checks it no more
    if env.rank == 1:
        with pytest.raises(ValueError, match="must pass counts"):
            d.allgatherv(torch.ones(3), [4, 4], group=G)
        others_done()  # (heartbeats go on: rank 0's wait times out)
        return ""
    with pytest.raises(CommunicationTimeout) as info:
        d.allgatherv(x, [4, 4], group=G).wait()
    return str(info.value)


def test_a_refusal_the_others_do_not_check_is_named_in_their_timeout() -> None:
    said = run_ranks(2, body_refused_after_a_known_call, timeout=60)[0]
    assert "it refused the arguments of its next call on this group: allgatherv: this rank " \
           "(group rank 1) must pass counts[1] = 4 rows" in said, said
