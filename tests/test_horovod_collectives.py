"""scaleout.horovod's collectives at 1, 2 and 3 ranks against analytic oracles, with autograd."""

from __future__ import annotations

import pytest
import torch

import scaleout.horovod as hvd
from harness import others_done, run_ranks
from scaleout.core import pairwise

# A process's first optimizer costs seconds of lazy torch imports: pay it once here, before
# the ranks fork, not in every rank of every test.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _value(rank: int, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 10 * rank


def body_identity() -> dict[str, object]:
    hvd.init(timeout=30)
    out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
           "cross_size": hvd.cross_size(), "init": hvd.is_initialized(),
           "homogeneous": hvd.is_homogeneous()}
    hvd.init()  # a second init is a no-op
    hvd.shutdown()
    out["after"] = hvd.is_initialized()
    try:
        hvd.rank()
    except ValueError as err:
        out["error"] = str(err)
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_identity(n: int) -> None:
    for r, got in enumerate(run_ranks(n, body_identity, timeout=90)):
        assert got["rank"] == r and got["size"] == n and got["init"] and not got["after"]
        assert got["local_rank"] == r and got["local_size"] == n
        assert got["cross_rank"] == 0 and got["cross_size"] == 1 and got["homogeneous"]
        assert "hvd.init()" in got["error"]


def body_two_nodes() -> tuple[int, int, int, int]:
    import os

    node = int(os.environ["RANK"]) // 2  # ranks 0,1 on node 0; 2,3 on node 1
    os.environ.update({"GROUP_RANK": str(node), "LOCAL_RANK": str(int(os.environ["RANK"]) % 2)})
    hvd.init(timeout=30)
    out = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    hvd.shutdown()
    return out


def test_local_and_cross_ranks_on_two_nodes() -> None:
    got = run_ranks(4, body_two_nodes, timeout=90)
    assert got == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


def body_allreduce() -> None:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    every = torch.stack([_value(q) for q in range(n)])
    x = _value(r)
    assert torch.allclose(hvd.allreduce(x), every.mean(0))
    assert torch.equal(x, _value(r))  # left unchanged
    assert torch.allclose(hvd.allreduce(x, average=False), every.sum(0))
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), every.min(0).values)
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), every.max(0).values)
    assert torch.allclose(hvd.allreduce(x + 1, op=hvd.Product), (every + 1).prod(0))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                          every.sum(0))
    ints = torch.tensor([r + 1, 2 * r], dtype=torch.int64)
    assert hvd.allreduce(ints, op=hvd.Sum).tolist() == [n * (n + 1) // 2, n * (n - 1)]
    assert hvd.allreduce(ints, op=hvd.Product).tolist()[0] == torch.arange(1, n + 1).prod().item()
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.allclose(y, every.sum(0))
    h = hvd.allreduce_async(x, name="async", op=hvd.Sum)
    h2 = hvd.allreduce_async_(y, name="async_", op=hvd.Max)
    assert isinstance(h, int)
    assert torch.allclose(hvd.synchronize(h), every.sum(0))
    while not hvd.poll(h2):
        pass
    assert hvd.synchronize(h2) is y
    fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert fp16.dtype == torch.float32 and torch.allclose(fp16, every.mean(0), rtol=1e-3)
    codec = hvd.allreduce(x, name="codec", compression=hvd.Compression.codec("cast:dtype=bf16"))
    assert torch.allclose(codec, every.mean(0), rtol=1e-2)
    # grouped
    outs = hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)
    assert torch.allclose(outs[1], 2 * every.sum(0))
    zs = [x.clone(), x.clone()]
    assert hvd.grouped_allreduce_(zs, op=hvd.Sum)[0] is zs[0]
    hg = hvd.grouped_allreduce_async([x, x], name="g")
    assert torch.allclose(hvd.synchronize(hg)[1], every.mean(0))
    hg = hvd.grouped_allreduce_async_(zs, op=hvd.Min)
    assert hvd.synchronize(hg)[0] is zs[0]
    # autograd: d/dx sum(allreduce(x) * w) = allreduce(w)
    w = torch.full((2, 3), float(r + 1))
    leaf = x.clone().requires_grad_()
    (hvd.allreduce(leaf, op=hvd.Sum) * w).sum().backward()
    assert torch.allclose(leaf.grad, torch.full((2, 3), n * (n + 1) / 2))
    hvd.shutdown()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_allreduce(n: int) -> None:
    run_ranks(n, body_allreduce, timeout=120)


def body_adasum() -> None:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    x = torch.zeros(4)
    x[r] = 1.0  # orthogonal: Adasum adds
    assert torch.allclose(hvd.allreduce(x, op=hvd.Adasum), torch.tensor([1.0] * n + [0.0] * (4 - n)))
    same = hvd.allreduce(torch.ones(3), op=hvd.Adasum)  # parallel and equal: Adasum averages
    assert torch.allclose(same, torch.ones(3))
    hvd.shutdown()


def body_adasum_odd() -> str:
    hvd.init(timeout=30)
    try:
        hvd.allreduce(torch.ones(3), op=hvd.Adasum)
    except NotImplementedError as err:
        return str(err)
    finally:
        hvd.shutdown()
    return "no error"


def test_adasum() -> None:
    run_ranks(2, body_adasum, timeout=90)
    assert all("power-of-two" in m for m in run_ranks(3, body_adasum_odd, timeout=90))


def body_gather_family() -> None:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    # allgather with different row counts per rank
    mine = torch.full((r + 1, 2), float(r))
    want = torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
    assert torch.equal(hvd.allgather(mine), want)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(mine, name="ag")), want)
    leaf = mine.clone().requires_grad_()
    (hvd.allgather(leaf) * (torch.arange(want.shape[0]).float()[:, None] + 1)).sum().backward()
    offset = sum(q + 1 for q in range(r))
    assert torch.allclose(leaf.grad, (torch.arange(offset, offset + r + 1).float()[:, None] + 1)
                          .expand(r + 1, 2))  # averaged over ranks: every rank sends the same
    # broadcast
    root = n - 1
    x = _value(r)
    assert torch.equal(hvd.broadcast(x, root_rank=root), _value(root))
    assert torch.equal(x, _value(r))
    y = _value(r)
    assert hvd.broadcast_(y, root) is y and torch.equal(y, _value(root))
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(_value(r), 0)), _value(0))
    z = _value(r)
    hvd.synchronize(hvd.broadcast_async_(z, 0, name="b"))
    assert torch.equal(z, _value(0))
    leaf = _value(r).requires_grad_()
    hvd.broadcast(leaf, root).sum().backward()
    assert torch.equal(leaf.grad, torch.ones(2, 3) if r == root else torch.zeros(2, 3))
    # alltoall: rank r sends (j + 1) rows of value 10 r + j to rank j
    splits = [j + 1 for j in range(n)]
    send = torch.cat([torch.full((j + 1,), 10.0 * r + j) for j in range(n)])
    out, received = hvd.alltoall(send, splits=splits)
    assert received.tolist() == [r + 1] * n
    assert torch.equal(out, torch.cat([torch.full((r + 1,), 10.0 * q + r) for q in range(n)]))
    even = torch.arange(float(2 * n)) + 100 * r
    got = hvd.alltoall(even)
    assert torch.equal(got, torch.tensor([100.0 * q + v for q in range(n) for v in (2 * r, 2 * r + 1)]))
    out2, rec2 = hvd.synchronize(hvd.alltoall_async(send, splits, name="a2a"))
    assert torch.equal(out2, out) and torch.equal(rec2, received)
    leaf = send.clone().requires_grad_()
    o, _ = hvd.alltoall(leaf, splits=splits)
    (o * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(send, 2.0))
    # reducescatter: even and uneven rows
    block = torch.ones(2 * n, 3) * (r + 1)
    total = n * (n + 1) / 2
    assert torch.allclose(hvd.reducescatter(block, op=hvd.Sum), torch.full((2, 3), total))
    assert torch.allclose(hvd.reducescatter(block), torch.full((2, 3), total / n))
    uneven = torch.ones(2 * n + 1, 1) * (r + 1)
    rows = 3 if r == 0 else 2
    assert hvd.reducescatter(uneven, op=hvd.Sum).shape == (rows, 1)
    assert torch.allclose(hvd.synchronize(hvd.reducescatter_async(block, op=hvd.Max)),
                          torch.full((2, 3), float(n)))
    leaf = block.clone().requires_grad_()
    hvd.reducescatter(leaf, op=hvd.Sum).sum().backward()
    assert torch.equal(leaf.grad, torch.ones(2 * n, 3))
    hvd.barrier()
    assert 0 <= hvd.join() < n  # every rank joins at once
    hvd.shutdown()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_family(n: int) -> None:
    run_ranks(n, body_gather_family, timeout=120)


def body_integer_scaling(dtype: torch.dtype) -> None:
    """Integer tensors are scaled as Horovod scales them: in float64, truncated toward zero
    (Average used to floor, -4.67 -> -5, and scale factors on them raised TypeError)."""
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    every = [[(-1) ** i * (q * q + 2 * i + 1) for i in range(n)] for q in range(n)]
    columns = list(zip(*every))  # sums not multiples of n, some negative
    want = {  # int() truncates toward zero, as a cast from double does
        "average": [int(sum(c) / n) for c in columns],
        "prescale": [sum(int(v * 0.5) for v in c) for c in columns],
        "postscale": [int(sum(c) * 0.5) for c in columns],
        "average_postscale": [int(sum(c) * 3.0 / n) for c in columns],
    }
    x = torch.tensor(every[r], dtype=dtype)
    got = {
        "average": hvd.allreduce(x),
        "prescale": hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5),
        "postscale": hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5),
        "average_postscale": hvd.synchronize(hvd.allreduce_async(x, postscale_factor=3.0)),
    }
    # reducescatter of one row per member: member r gets element r of the allreduce
    rows = x.reshape(n, 1)
    scattered = {"average": hvd.reducescatter(rows),
                 "prescale": hvd.reducescatter(rows, op=hvd.Sum, prescale_factor=0.5)}
    for key, value in got.items():
        assert value.dtype == dtype and value.tolist() == want[key], (key, value, want[key])
    for key, value in scattered.items():
        assert value.dtype == dtype and value.tolist() == [[want[key][r]]], (key, value)
    hvd.shutdown()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_tensors_are_scaled_in_float64_and_truncated(dtype: torch.dtype) -> None:
    run_ranks(3, body_integer_scaling, dtype, timeout=90)


def _raises(kind: type[BaseException], text: str, fn) -> str:
    try:
        fn()
    except kind as err:
        assert text in str(err), f"{text!r} not in {err}"
        return str(err)
    raise AssertionError(f"expected {kind.__name__} with {text!r}")


def body_mismatch() -> list[str]:
    hvd.init(timeout=20)
    r = hvd.rank()
    msgs = [
        _raises(hvd.TensorMismatchError, "mismatched shapes",
                lambda: hvd.allreduce(torch.ones(2 + r))),
        _raises(hvd.TensorMismatchError, "mismatched data types",
                lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64))),
        _raises(RuntimeError, "named its tensor differently",
                lambda: hvd.allreduce(torch.ones(2), name=f"t{r}")),
        _raises(ValueError, "mismatched reduction ops",
                lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max)),
        _raises(hvd.TensorMismatchError, "trailing shapes",
                lambda: hvd.allgather(torch.ones(2, 1 + r))),
        _raises(hvd.TensorMismatchError, "mismatched prescale_factor / postscale_factor",
                lambda: hvd.allreduce(torch.ones(2), prescale_factor=0.5 if r else 1.0)),
        _raises(hvd.TensorMismatchError, "mismatched prescale_factor / postscale_factor",
                lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, postscale_factor=1.0 + r)),
        _raises(hvd.TensorMismatchError, "mismatched root ranks",
                lambda: hvd.broadcast(torch.ones(2), root_rank=r)),
        _raises(hvd.TensorMismatchError, "different collective",
                lambda: hvd.allreduce(torch.ones(2)) if r else hvd.allgather(torch.ones(2))),
    ]
    # after all these errors the job still works (the unnamed-call counters of the two
    # ranks differ after the last case, so name the call)
    assert torch.equal(hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum), torch.full((2,), 2.0))
    hvd.shutdown()
    return msgs


def test_mismatches_raise_on_every_rank() -> None:
    msgs = run_ranks(2, body_mismatch, timeout=120)
    assert "rank 0" in msgs[0][0] and "rank 1" in msgs[1][0] and "[2] there, [3] here" in msgs[1][0]


def body_bad_arguments() -> None:
    hvd.init(timeout=20)
    _raises(TypeError, "expected a torch.Tensor", lambda: hvd.allreduce([1.0, 2.0]))
    _raises(ValueError, "op must be one of", lambda: hvd.allreduce(torch.ones(2), op=17))
    _raises(ValueError, "not both", lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum))
    _raises(ValueError, "root_rank must be a rank", lambda: hvd.broadcast(torch.ones(2), 5))
    _raises(ValueError, "splits add up to more than",
            lambda: hvd.alltoall(torch.ones(4), splits=[3, 2]))
    _raises(ValueError, "multiple of", lambda: hvd.alltoall(torch.ones(3)))
    _raises(ValueError, "op must be hvd.Average, Sum, Min or Max",
            lambda: hvd.reducescatter(torch.ones(4), op=hvd.Product))
    _raises(ValueError, "at least one dimension", lambda: hvd.reducescatter(torch.tensor(1.0)))
    _raises(TypeError, "prescale_factor must be a number",
            lambda: hvd.allreduce(torch.ones(2), prescale_factor="2"))
    assert hvd.synchronize(12345) is None  # as Horovod (since stop 52)
    _raises(ValueError, "was not created or has been cleared", lambda: hvd.poll(12345))
    _raises(TypeError, "handle must be an int", lambda: hvd.poll("x"))
    _raises(ValueError, "hvd.Average or hvd.Sum",
            lambda: hvd.allreduce(torch.ones(2), op=hvd.Max, compression=hvd.Compression.codec("topk")))
    _raises(NotImplementedError, "MPI communicator", lambda: hvd.init(comm=object()))
    leaf = torch.ones(4, requires_grad=True)
    _raises(NotImplementedError, "has no gradient",
            lambda: hvd.reducescatter(leaf, op=hvd.Min).sum().backward())
    hvd.shutdown()


def test_bad_arguments() -> None:
    run_ranks(2, body_bad_arguments, timeout=120)


def body_join() -> dict[str, object]:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    for s in range(r + 1):  # rank r has r + 1 batches; at step s ranks s.. n-1 are active
        active = range(s, n)
        mine = torch.tensor([r + 1.0])
        assert hvd.allreduce(mine, op=hvd.Sum, name=f"sum{s}").item() == sum(q + 1 for q in active)
        total = sum(q + 1 for q in active)
        assert [t.item() for t in hvd.grouped_allreduce([mine, 2 * mine], op=hvd.Sum)] \
            == [total, 2 * total]
        assert hvd.grouped_allreduce([]) == []  # the joined ranks pass the header of no tensors
        assert hvd.allreduce(mine, op=hvd.Min).item() == s + 1
        assert hvd.allreduce(mine, op=hvd.Max).item() == n
        assert hvd.allreduce(mine, op=hvd.Product).item() == torch.tensor(
            [q + 1.0 for q in active]).prod().item()
        assert hvd.allreduce(mine.half(), op=hvd.Sum, compression=hvd.Compression.fp16).item() \
            == sum(q + 1 for q in active)
        rows = hvd.allgather(torch.full((r + 1, 2), float(r)))
        assert rows[:, 0].tolist() == [float(q) for q in active for _ in range(q + 1)]
        opt.zero_grad()
        (model.weight.sum() * (r + 1)).backward()  # gradient r + 1
        opt.step()  # averaged over all n ranks, joined ones giving zeros
    last = hvd.join()
    out = {"last": last, "weight": model.weight.item()}
    try:  # after the join every rank is active again
        hvd.broadcast(torch.ones(1), root_rank=0)
    except Exception as err:  # noqa: BLE001
        out["after"] = repr(err)
    hvd.shutdown()
    return out


def body_join_refuses() -> str:
    hvd.init(timeout=30)
    if hvd.rank() == 0:
        hvd.join()
        hvd.shutdown()
        return "joined"
    try:
        hvd.broadcast(torch.ones(1), root_rank=1)
    except hvd.TensorMismatchError as err:
        message = str(err)
    hvd.join()
    hvd.shutdown()
    return message


@pytest.mark.parametrize("n", [2, 3])
def test_join_lets_ranks_run_different_numbers_of_batches(n: int) -> None:
    got = run_ranks(n, body_join, timeout=120)
    assert all(g["last"] == n - 1 and "after" not in g for g in got)
    # rank n-1 ran every step: w = -sum over steps s of (sum of q+1 for active q) / n
    want = -sum(sum(q + 1 for q in range(s, n)) for s in range(n)) / n
    assert got[n - 1]["weight"] == pytest.approx(want)


def test_join_refuses_collectives_it_cannot_stand_in_for() -> None:
    got = run_ranks(2, body_join_refuses, timeout=120)
    assert got[0] == "joined" and "has called hvd.join()" in got[1]


def body_peer_never_comes() -> str:
    import time

    from scaleout.core.errors import CommunicationTimeout

    hvd.init(timeout=2)
    if hvd.rank() == 1:
        others_done()  # never calls the allreduce
        return "slept"
    began = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="late")
    except CommunicationTimeout as err:
        assert time.monotonic() - began < 4.5
        return str(err)
    return "no error"


def test_a_missing_peer_is_an_error_naming_rank_group_and_call() -> None:
    message = run_ranks(2, body_peer_never_comes, timeout=60)[0]
    assert message.startswith("rank 0: allreduce 'late' on group global[0, 1]: the other ranks "
                              "did not reach this call within 2 s"), message


def body_peer_exits() -> object:
    from scaleout.core.errors import PeerFailedError

    hvd.init(timeout=10)
    if hvd.rank() == 1:
        return "left"  # its process exits without meeting rank 0 again
    try:
        hvd.allreduce(torch.ones(2), name="orphan")
    except PeerFailedError as err:
        return err.failed_rank, str(err)
    return "no error"


def test_a_peer_that_exits_is_an_error_naming_it_and_the_call() -> None:
    (failed, message), _ = run_ranks(2, body_peer_exits, timeout=60)
    assert failed == 1 and message.startswith("rank 0: allreduce 'orphan' on group global[0, 1]")
    assert "rank 1 failed" in message, message


def body_join_refuses_barrier() -> str:
    hvd.init(timeout=10)
    if hvd.rank() == 0:
        hvd.join()
        hvd.shutdown()
        return "joined"
    try:
        hvd.barrier()
        message = "barrier passed"
    except hvd.TensorMismatchError as err:
        message = str(err)
    hvd.join()
    hvd.shutdown()
    return message


def test_join_refuses_a_barrier_on_every_rank() -> None:
    """A barrier while a rank has joined raises, as documented (it used to hang)."""
    got = run_ranks(2, body_join_refuses_barrier, timeout=40)
    assert got[0] == "joined" and "has called hvd.join()" in got[1], got


def body_one_rank_refuses() -> list[str]:
    import time

    hvd.init(timeout=60)  # a wait for the others would take a minute: none must happen
    r = hvd.rank()
    began = time.monotonic()
    calls = [
        lambda: hvd.allreduce(torch.ones(2) if r == 0 else torch.ones(2, dtype=torch.bool)),
        lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=2.0 if r == 0 else "x"),
        lambda: hvd.allgather(torch.ones(2) if r == 0 else [1.0, 2.0]),
        lambda: hvd.broadcast(torch.ones(2), root_rank=0 if r == 0 else 7),
        lambda: hvd.alltoall(torch.ones(4), splits=[2, 2] if r == 0 else [3, 3]),
        lambda: hvd.reducescatter(torch.ones(4), op=hvd.Sum if r == 0 else hvd.Product),
    ]
    seen = []
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as err:
            seen.append(type(err).__name__ + ": " + str(err))
        else:
            seen.append("no error")
    assert time.monotonic() - began < 20
    hvd.shutdown()
    return seen


def test_arguments_refused_on_one_rank_raise_on_every_rank_at_once() -> None:
    rank0, rank1 = run_ranks(2, body_one_rank_refuses, timeout=90)
    assert all("refused its arguments to this call" in m for m in rank0), rank0
    assert not any("refused its arguments" in m for m in rank1), rank1
    assert all(m.startswith(("TypeError", "ValueError")) for m in rank1), rank1


#: rows of 16 float32 values: a block twice the receive-first exchange's threshold
LARGE_ROWS = 2 * pairwise.MIN_BLOCK_BYTES // (16 * 4)


def body_join_stands_in_for_a_large_allgather() -> list[float]:
    """The joined rank's stand-in sends no rows while the other sends a block above the
    receive-first threshold (scaleout.core.pairwise): both must take the same path."""
    hvd.init(timeout=20)
    rows = LARGE_ROWS
    gathered: list[float] = []
    if hvd.rank() == 1:
        out = hvd.allgather(torch.full((rows, 16), 7.0))
        gathered = [float(out.shape[0]), float(out.sum())]
    hvd.join()
    hvd.shutdown()
    return gathered


def test_join_stands_in_for_an_allgather_above_the_exchange_threshold() -> None:
    got = run_ranks(2, body_join_stands_in_for_a_large_allgather, timeout=60)
    assert got == [[], [float(LARGE_ROWS), 7.0 * LARGE_ROWS * 16]]


def body_group_lengths_differ() -> list[str]:
    import time

    hvd.init(timeout=10)  # a wait for the other rank would take 10 s: none must happen
    r = hvd.rank()
    began = time.monotonic()
    calls = [  # rank 0 passes one tensor more than rank 1 (none in the last two cases)
        lambda: hvd.grouped_allreduce([torch.ones(2)] * (2 - r)),
        lambda: hvd.grouped_allreduce_([torch.ones(2)] * (2 - r), name="g"),
        lambda: hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(2)] * (1 - r))),
        lambda: hvd.broadcast_parameters({f"w{i}": torch.ones(2) for i in range(2 - r)}, 0),
        lambda: hvd.broadcast_parameters([("w", torch.ones(2))] * (1 - r), 0),
    ]
    seen = []
    for call in calls:
        try:
            call()
            seen.append("no error")
        except hvd.TensorMismatchError as err:
            seen.append(str(err))
    assert time.monotonic() - began < 5, seen
    # the job goes on: the same call on both ranks gives the right answer
    total = hvd.grouped_allreduce([torch.ones(2)] * 2, name="after", op=hvd.Sum)
    assert [t.tolist() for t in total] == [[2.0, 2.0]] * 2
    hvd.shutdown()
    return seen


def test_group_lengths_that_differ_raise_on_every_rank() -> None:
    """grouped_allreduce and broadcast_parameters with different numbers of tensors on
    different ranks raise on every rank at once (they used to time out on one rank only, or
    to skip the exchange for an empty list and pair with the next collective)."""
    for messages in run_ranks(2, body_group_lengths_differ, timeout=60):
        assert all("tensors" in m and "rank" in m for m in messages), messages



def body_join_refuses_objects(root: int) -> list[str]:
    hvd.init(timeout=5)
    if hvd.rank() == 0:
        hvd.join()
        hvd.shutdown()
        return ["joined"]
    seen = []
    for call in (lambda: hvd.broadcast_object({"a": 1}, root_rank=root),
                 lambda: hvd.allgather_object({"a": 1})):
        try:
            call()
            seen.append("passed")
        except hvd.TensorMismatchError as err:
            seen.append(str(err))
    hvd.join()  # the job can still end cleanly
    hvd.shutdown()
    return seen


@pytest.mark.parametrize("root", [0, 1])
def test_join_refuses_object_collectives_on_every_rank(root: int) -> None:
    """broadcast_object and allgather_object while a rank has joined raise on the active rank
    and leave the job able to finish (allgather_object used to abort the active rank in gloo;
    after a timed-out broadcast_object its join() hung)."""
    joined, active = run_ranks(2, body_join_refuses_objects, root, timeout=40)
    assert joined == ["joined"] and len(active) == 2, active
    assert all("has called hvd.join()" in m for m in active), active
