"""Stop 52: divergences from Horovod found in the collectives, each with its oracle."""

from __future__ import annotations

import pytest
import torch

import scaleout.horovod as hvd
from harness import run_ranks


def _outcome(call) -> str:  # noqa: ANN001 - a thunk
    try:
        return repr(call())
    except Exception as err:  # noqa: BLE001 - the test compares the type and message
        return f"{type(err).__name__}: {err}"


def body_reducescatter_scales() -> dict[str, str]:
    hvd.init(timeout=20)
    r, n = hvd.rank(), hvd.size()
    out = {
        # a factor that is not a number: TypeError here, named, on the rank that passed it;
        # before, "can't multiply sequence by non-int of type 'float'" after the exchange,
        # and the ranks that passed numbers waited in the collective until the timeout
        "bad": _outcome(lambda: hvd.reducescatter(torch.ones(n), prescale_factor="2"
                                                  if r == 0 else 1.0)),
        # ranks that scale differently: refused on every rank (before: each rank its own
        # scaling of the same sum, silently: [2., 2.] on rank 0, [4., 4.] on rank 1 at 2 ranks)
        "mixed": _outcome(lambda: hvd.reducescatter(torch.ones(2 * n), op=hvd.Sum,
                                                    postscale_factor=1.0 + r).tolist()),
        "same": _outcome(lambda: hvd.reducescatter(torch.ones(2 * n), op=hvd.Sum,
                                                   prescale_factor=3.0,
                                                   postscale_factor=0.5).tolist()),
    }
    hvd.shutdown()
    return out


def test_reducescatter_scale_factors_are_checked_and_compared() -> None:
    got = run_ranks(2, body_reducescatter_scales, timeout=90)
    assert got[0]["bad"].startswith("TypeError: reducescatter: prescale_factor must be a number")
    assert got[1]["bad"].startswith("TensorMismatchError") and "refused" in got[1]["bad"]
    for one in got:
        assert "mismatched prescale_factor / postscale_factor" in one["mixed"], one
        assert one["same"] == repr([3.0, 3.0])  # 2 ranks x 3 x 0.5


def body_alltoall_short_splits() -> tuple[list[float], list[int], list[float]]:
    hvd.init(timeout=20)
    r, n = hvd.rank(), hvd.size()
    # 5 rows, splits cover n of them (one row to each rank): Horovod sends those, not the rest
    x = (torch.arange(5.0) + 10 * r).requires_grad_()
    out, received = hvd.alltoall(x, splits=[1] * n)
    (out * torch.arange(1.0, n + 1)).sum().backward()
    hvd.shutdown()
    return out.tolist(), received.tolist(), x.grad.tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_alltoall_splits_may_cover_fewer_rows(n: int) -> None:
    # before: ValueError "splits must add up to dim 0 of the tensor (5)"
    for r, (out, received, grad) in enumerate(run_ranks(n, body_alltoall_short_splits,
                                                        timeout=90)):
        assert out == [10.0 * q + r for q in range(n)]
        assert received == [1] * n
        # rank r's row j went to rank j, which weighed it by r + 1; unsent rows get zero
        assert grad == [float(r + 1)] * n + [0.0] * (5 - n)


def body_broadcast_object_root() -> list[str]:
    hvd.init(timeout=20)
    out = [_outcome(lambda: hvd.broadcast_object("x", root_rank="0")),
           _outcome(lambda: hvd.broadcast_object("x", root_rank=True)),
           _outcome(lambda: hvd.broadcast_object({"r": hvd.rank()}, root_rank=1))]
    hvd.shutdown()
    return out


def test_broadcast_object_root_must_be_an_int() -> None:
    # before: root_rank="0" raised "root_rank must be a rank of the process set [0, 1], got 0"
    # and root_rank=True broadcast rank 1's object
    for got in run_ranks(2, body_broadcast_object_root, timeout=90):
        assert got[0] == "TypeError: broadcast_object: root_rank must be an int, got str"
        assert got[1] == "TypeError: broadcast_object: root_rank must be an int, got bool"
        assert got[2] == repr({"r": 1})


def body_bad_op_on_one_rank() -> list[str]:
    hvd.init(timeout=30)
    bad = "sum" if hvd.rank() == 1 else hvd.Sum  # rank 1 passes a string: not an op
    out = [_outcome(lambda: hvd.allreduce(torch.ones(2), op=bad)),
           _outcome(lambda: hvd.allreduce_(torch.ones(2), op=bad)),
           _outcome(lambda: hvd.grouped_allreduce([torch.ones(2)], op=bad)),
           _outcome(lambda: hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(2)],
                                                                       op=bad))),
           _outcome(lambda: hvd.reducescatter(torch.ones(4), op=bad)),
           _outcome(lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())]
    hvd.shutdown()
    return out


def test_a_bad_op_on_one_rank_is_an_error_on_every_rank_at_once() -> None:
    # before: rank 1 raised its ValueError at once and rank 0 waited at the collective until
    # the timeout (30 s here, each call), then failed naming a rank "not at this call"
    import time
    start = time.monotonic()
    got = run_ranks(2, body_bad_op_on_one_rank, timeout=120)
    assert time.monotonic() - start < 25
    for call in range(5):
        assert got[1][call].startswith("ValueError") and "op must be one of" in got[1][call]
        assert got[0][call].startswith("TensorMismatchError") and "refused" in got[0][call]
    assert got[0][5] == got[1][5] == repr([2.0, 2.0])  # the ranks still agree afterwards
