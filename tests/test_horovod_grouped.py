"""Stop 52: grouped_allgather / grouped_reducescatter (async and blocking) at 1, 2 and 3 ranks
against hand computations; ``synchronize`` / ``poll`` on a spent handle; ``join()``'s answer."""

from __future__ import annotations

import pytest
import torch

import scaleout.horovod as hvd
from harness import run_ranks


def _rows(rows: int, size: int) -> list[int]:
    """Horovod's split of dim 0, written out: the first ``rows % size`` members get one more."""
    base, extra = divmod(rows, size)
    return [base + 1 if i < extra else base for i in range(size)]


def _mine(full: torch.Tensor, size: int, index: int) -> torch.Tensor:
    sizes = _rows(full.shape[0], size)
    return full[sum(sizes[:index]):sum(sizes[:index + 1])]


def _gather_inputs(r: int) -> list[torch.Tensor]:
    # rank r: r + 1 rows (uneven first dims), and an int tensor of 2 - (r % 2) rows
    return [torch.arange(2.0 * (r + 1)).reshape(r + 1, 2) + 100 * r,
            torch.full((2 - r % 2,), r, dtype=torch.int64)]


def _scatter_inputs(r: int, n: int) -> list[torch.Tensor]:
    # 2n + 1 rows: uneven blocks at every size but 1; an int tensor of n + 2 rows
    return [torch.arange(2.0 * (2 * n + 1)).reshape(2 * n + 1, 2) * (r + 1),
            torch.arange(n + 2, dtype=torch.int64) * 3 + r]


def body_grouped(members: list[int] | None) -> dict[str, object]:
    hvd.init(timeout=30)
    ps = hvd.global_process_set if members is None else hvd.add_process_set(members)
    out: dict[str, object] = {}
    if not ps.included():
        hvd.shutdown()
        return out
    r, n = ps.rank(), ps.size()
    ranks = list(range(n))
    # grouped_allgather_async: each tensor concatenated along dim 0 over the set, in rank order
    h = hvd.grouped_allgather_async(_gather_inputs(r), name="ga", process_set=ps)
    got = hvd.synchronize(h)
    want = [torch.cat([_gather_inputs(q)[i] for q in ranks]) for i in range(2)]
    assert isinstance(got, list) and len(got) == 2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    out["ga_rows"] = [g.shape[0] for g in got]
    # blocking, unnamed, differentiable (Horovod: the gradient is this rank's rows of the
    # averaged incoming gradient)
    leaf = (torch.ones(r + 1, 3) * (r + 1)).requires_grad_()
    gathered = hvd.grouped_allgather([leaf, torch.zeros(1)], process_set=ps)
    assert gathered[0].shape == (sum(q + 1 for q in ranks), 3)
    (gathered[0] * torch.arange(1.0, gathered[0].shape[0] + 1)[:, None]).sum().backward()
    offset = sum(q + 1 for q in range(r))
    assert torch.equal(leaf.grad, torch.arange(offset + 1.0, offset + r + 2)[:, None].expand(r + 1, 3))
    # grouped_reducescatter_async, default op Average (as Horovod), uneven dim 0
    h = hvd.grouped_reducescatter_async(_scatter_inputs(r, n), name="rs", process_set=ps)
    got = hvd.synchronize(h)
    every = [torch.stack([_scatter_inputs(q, n)[i] for q in ranks]) for i in range(2)]
    assert torch.allclose(got[0], _mine(every[0].sum(0) / n, n, r))
    # integers: the sum times 1/n in float64, truncated toward zero (Horovod's scaling)
    ints = _mine((every[1].sum(0).double() / n).to(torch.int64), n, r)
    assert got[1].dtype == torch.int64 and torch.equal(got[1], ints), (got[1], ints)
    out["rs_rows"] = [g.shape[0] for g in got]
    # Sum with prescale and postscale, blocking
    got = hvd.grouped_reducescatter(_scatter_inputs(r, n), op=hvd.Sum, prescale_factor=2.0,
                                    postscale_factor=0.25, process_set=ps)
    assert torch.allclose(got[0], _mine(every[0].sum(0) * 0.5, n, r))
    pre = torch.stack([(_scatter_inputs(q, n)[1].double() * 2).long() for q in ranks]).sum(0)
    assert torch.equal(got[1], _mine((pre.double() * 0.25).long(), n, r))
    # Max, and an empty list
    got = hvd.grouped_reducescatter([torch.tensor([1.0 * r, -1.0 * r] * n)], op=hvd.Max,
                                    process_set=ps)
    assert torch.equal(got[0], torch.tensor([n - 1.0, 0.0]))
    assert hvd.synchronize(hvd.grouped_allgather_async([], process_set=ps)) == []
    # a spent handle: synchronize returns None as Horovod's; poll raises ValueError as Horovod's
    h = hvd.grouped_allgather_async([torch.ones(1)], process_set=ps)
    assert hvd.synchronize(h) is not None
    assert hvd.synchronize(h) is None
    with pytest.raises(ValueError, match="was not created or has been cleared"):
        hvd.poll(h)
    hvd.shutdown()
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_grouped_allgather_and_reducescatter(n: int) -> None:
    got = run_ranks(n, body_grouped, None, timeout=120)
    for r, one in enumerate(got):
        assert one["ga_rows"] == [n * (n + 1) // 2, sum(2 - q % 2 for q in range(n))]
        assert one["rs_rows"] == [_rows(2 * n + 1, n)[r], _rows(n + 2, n)[r]]


def test_grouped_on_a_process_set() -> None:
    got = run_ranks(3, body_grouped, [0, 2], timeout=120)
    assert got[1] == {}  # not a member
    assert got[0]["ga_rows"] == got[2]["ga_rows"] == [3, 3]
    assert got[0]["rs_rows"] == [3, 2] and got[2]["rs_rows"] == [2, 2]


def body_grouped_mismatch() -> list[str]:
    hvd.init(timeout=30)
    r = hvd.rank()
    errors = []
    for call in (lambda: hvd.grouped_allgather_async([torch.ones(1)] * (r + 1)),
                 lambda: hvd.grouped_reducescatter([torch.ones(4)] * (r + 1)),
                 lambda: hvd.grouped_reducescatter([torch.ones(4)], postscale_factor=1.0 + r),
                 lambda: hvd.grouped_allgather([torch.ones(2, 1 + r)])):
        try:
            call()
            errors.append("no error")
        except hvd.TensorMismatchError as err:
            errors.append(str(err))
    try:
        hvd.grouped_reducescatter_async(torch.ones(4))
    except TypeError as err:
        errors.append(str(err))
    hvd.shutdown()
    return errors


def test_grouped_mismatches_raise_on_every_rank() -> None:
    for errors in run_ranks(2, body_grouped_mismatch, timeout=120):
        assert "passed" in errors[0] and "tensors" in errors[0], errors
        assert "passed" in errors[1] and "tensors" in errors[1], errors
        assert "prescale_factor / postscale_factor" in errors[2], errors
        assert "trailing shapes" in errors[3], errors
        assert "grouped_reducescatter: tensors must be a list" in errors[4], errors


def body_join_skewed_clock() -> int:
    import time

    hvd.init(timeout=30)
    if hvd.rank() == 1:  # this host's clock runs 1000 s ahead; it joins first
        real = time.time
        time.time = lambda: real() + 1000.0
        return hvd.join()
    hvd.allreduce(torch.ones(2), name="still.training")  # rank 1 stands in
    time.sleep(0.2)
    return hvd.join()


def test_join_names_the_last_rank_whatever_the_clocks() -> None:
    # Rank 0 ran a collective after rank 1 joined: it joined last, on every rank, even though
    # rank 1's clock says later (before stop 52: [1, 1], by wall clock alone).
    assert run_ranks(2, body_join_skewed_clock, timeout=90) == [0, 0]


def body_join_same_round(late: int) -> int:
    import time

    hvd.init(timeout=30)
    if hvd.rank() == late:
        time.sleep(0.3)
    return hvd.join()


@pytest.mark.parametrize("n,late", [(2, 0), (3, 1)])
def test_join_between_the_same_collectives_goes_by_time(n: int, late: int) -> None:
    # No collective between the joins: the rank that called join() last, as Horovod's
    # coordinator sees the requests arrive; the same answer on every rank.
    assert run_ranks(n, body_join_same_round, late, timeout=90) == [late] * n


def body_join_stands_in_for_grouped_allgather() -> list[list[float]]:
    hvd.init(timeout=30)
    got = []
    if hvd.rank() == 0:  # rank 1 has joined: it contributes no rows
        got = [t.tolist() for t in hvd.grouped_allgather([torch.ones(2), torch.zeros(1, 2)])]
    hvd.join()
    hvd.shutdown()
    return got


def test_join_stands_in_for_grouped_allgather() -> None:
    assert run_ranks(2, body_join_stands_in_for_grouped_allgather, timeout=90)[0] == [
        [1.0, 1.0], [[0.0, 0.0]]]
