"""scaleout.horovod's training pieces at 1, 2 and 3 ranks: DistributedOptimizer, parameter and
optimizer-state broadcast, SyncBatchNorm, against single-process references."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import scaleout.horovod as hvd
from harness import run_ranks
from scaleout.horovod.errors import NotInitialized

# A process's first optimizer costs seconds of lazy torch imports: pay it once here, before
# the ranks fork, not in every rank of every test.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

BATCH = 6  # per rank


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n * BATCH, 4, generator=g), torch.randint(0, 3, (n * BATCH,), generator=g)


def _reference(n: int, steps: int, accumulate: int = 1) -> list[torch.Tensor]:
    """Single process, on every rank's samples at once (the mean loss over them)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = _data(n, step * accumulate + micro)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def body_optimizer(steps: int, accumulate: int, predivide: float) -> list[torch.Tensor]:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    model = _model(seed=r)  # different on purpose: the broadcast fixes it
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=accumulate,
                                   gradient_predivide_factor=predivide)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=100)  # accepts the wrapper
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = _data(n, step * accumulate + micro)
            mine = slice(r * BATCH, (r + 1) * BATCH)
            nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        scheduler.step()
    hvd.shutdown()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("n,accumulate,predivide", [(1, 1, 1.0), (2, 1, 1.0), (3, 2, 1.0),
                                                     (2, 1, 2.0)])
def test_distributed_optimizer_equals_single_process(n: int, accumulate: int,
                                                     predivide: float) -> None:
    want = _reference(n, 3, accumulate)
    for got in run_ranks(n, body_optimizer, 3, accumulate, predivide, timeout=120):
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()


def body_optimizer_modes() -> dict[str, object]:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    out: dict[str, object] = {}
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16, op=hvd.Sum)
    x, y = _data(n, 0)
    mine = slice(r * BATCH, (r + 1) * BATCH)
    nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    try:
        opt.zero_grad()
    except RuntimeError as err:
        out["zero_grad"] = str(err)
    opt.synchronize()
    out["clipped"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
    with opt.skip_synchronize():
        opt.step()
    out["norm_after_clip"] = float(sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5)
    # a second backward without step exceeds backward_passes_per_step=1
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    try:
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    except RuntimeError as err:
        out["twice"] = str(err)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warned"] = any("skip_synchronize" in str(w.message) for w in caught)
    # codec compression and Adasum go through the same hooks
    for kwargs in ({"compression": hvd.Compression.codec("topk:ratio=0.5")}, {"op": hvd.Adasum}):
        if kwargs.get("op") is hvd.Adasum and n & (n - 1):
            continue
        m = _model()
        o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters(), **kwargs)
        nn.functional.cross_entropy(m(x[mine]), y[mine]).backward()
        o.step()
        flat = torch.cat([p.detach().flatten() for p in m.parameters()])
        same = hvd.allgather(flat[None])
        out.setdefault("replicas_equal", []).append(bool((same == same[0]).all()))
    # argument errors
    for bad, text in ((dict(backward_passes_per_step=0), "backward_passes_per_step"),
                      (dict(named_parameters=[("a", p) for p in model.parameters()]), "duplicate"),
                      (dict(named_parameters=[]), "does not name"),
                      (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "needs op=hvd.Average")):
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **bad)
        except ValueError as err:
            assert text in str(err), err
        else:
            raise AssertionError(f"no error for {bad}")
    hvd.shutdown()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_modes(n: int) -> None:
    for got in run_ranks(n, body_optimizer_modes, timeout=120):
        assert "before optimizer.step() or optimizer.synchronize()" in got["zero_grad"]
        assert got["norm_after_clip"] <= 1e-3 * 1.01
        assert "backward_passes_per_step=1" in got["twice"]
        assert got["warned"]
        assert all(got["replicas_equal"])


def body_sync_batch_norm() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hvd.init(timeout=30)
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    x = torch.randn(n * 4, 3, 5, 5)
    bn = hvd.SyncBatchNorm(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
    mine = x[r * 4:(r + 1) * 4].clone().requires_grad_()
    y = bn(mine)
    (y * torch.arange(y.numel()).reshape(y.shape).float().sin()[:]).sum().backward()
    hvd.shutdown()
    return y.detach(), mine.grad, bn.running_var.detach()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(n * 4, 3, 5, 5).requires_grad_()
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
    y = bn(x)
    weights = torch.cat([torch.arange(4 * 75).reshape(4, 3, 5, 5).float().sin()] * n)
    (y * weights).sum().backward()
    for r, (got_y, got_grad, got_var) in enumerate(run_ranks(n, body_sync_batch_norm, timeout=120)):
        assert torch.allclose(got_y, y[r * 4:(r + 1) * 4].detach(), atol=1e-5)
        assert torch.allclose(got_grad, x.grad[r * 4:(r + 1) * 4], atol=1e-4)
        assert torch.allclose(got_var, bn.running_var, atol=1e-5)


def body_sync_batch_norm_half(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hvd.init(timeout=20)
    r = hvd.rank()
    torch.manual_seed(0)
    x = torch.randn(4, 3, 15, 15) * 0.5 + 20.0  # activations off centre, as before a BN
    bn = hvd.SyncBatchNorm(3).to(dtype)
    mine = x[r * 2:(r + 1) * 2].to(dtype).requires_grad_()
    y = bn(mine)
    y.float().sum().backward()
    hvd.shutdown()
    return y.detach().float(), bn.running_mean.float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sync_batch_norm_in_half_precision(dtype: torch.dtype) -> None:
    """Statistics of float16/bfloat16 inputs are kept in float32, as torch's batch norm keeps
    them (in the input's dtype, the variance was lost: errors of 4 and 500 here)."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 15, 15) * 0.5 + 20.0
    want = nn.functional.batch_norm(x, None, None, training=True)
    # tolerance: the input's rounding (2 ulps at 20) over the standard deviation 0.5
    tolerance = 2 * torch.finfo(dtype).eps * 20.0 / 0.5
    for r, (y, running_mean) in enumerate(run_ranks(2, body_sync_batch_norm_half, dtype,
                                                    timeout=60)):
        assert (y - want[r * 2:(r + 1) * 2]).abs().max() <= tolerance
        assert torch.allclose(running_mean, torch.full((3,), 2.0), atol=0.02)


OFFSETS = [0.0, 1e3, 1e4]
SPLITS = [(8, 8), (3, 13), (0, 16)]  # rows per rank (a rank may have none)


def _off_centre(offset: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 3, 4, generator=g) + offset


def body_sync_batch_norm_off_centre() -> list[tuple[torch.Tensor, ...]]:
    hvd.init(timeout=30)
    r = hvd.rank()
    out = []
    for offset in OFFSETS:
        for split in SPLITS:
            start = sum(split[:r])
            mine = _off_centre(offset)[start:start + split[r]].clone().requires_grad_()
            bn = hvd.SyncBatchNorm(3)
            y = bn(mine)
            (y * _loss_weights(16)[start:start + split[r]]).sum().backward()
            out.append((y.detach(), mine.grad, bn.running_mean, bn.running_var))
    hvd.shutdown()
    return out


def _loss_weights(rows: int) -> torch.Tensor:
    return torch.arange(rows * 3 * 4).reshape(rows, 3, 4).float().sin()


def test_sync_batch_norm_far_from_zero() -> None:
    """Inputs whose mean is large against their spread (offset 1e3 and 1e4, std 1, float32):
    the variance as E[x^2] - E[x]^2 of float32 sums lost it (errors of 0.7 at 1e3, NaN at
    1e4); each rank's centred moments, combined exactly, match BatchNorm1d on the whole batch,
    with uneven batches and a rank without rows."""
    got = run_ranks(2, body_sync_batch_norm_off_centre, timeout=120)
    cases = [(offset, split) for offset in OFFSETS for split in SPLITS]
    for i, (offset, split) in enumerate(cases):
        x = _off_centre(offset).requires_grad_()
        bn = nn.BatchNorm1d(3)
        y = bn(x)
        (y * _loss_weights(16)).sum().backward()
        # both sides round the mean to float32: an ulp of it over the std (1), and some
        tolerance = 2 * torch.finfo(torch.float32).eps * (offset + 4.0)
        for r in range(2):
            start = sum(split[:r])
            rows = slice(start, start + split[r])
            got_y, got_grad, got_mean, got_var = got[r][i]
            assert torch.allclose(got_y, y[rows].detach(), rtol=0, atol=tolerance), (offset, split)
            assert torch.allclose(got_grad, x.grad[rows], rtol=0, atol=tolerance), (offset, split)
            assert torch.allclose(got_mean, bn.running_mean, rtol=1e-6, atol=1e-6), (offset, split)
            assert torch.allclose(got_var, bn.running_var, rtol=1e-5), (offset, split)


def body_mismatched_models() -> list[str]:
    hvd.init(timeout=30)
    r = hvd.rank()
    model = nn.Linear(4, 2 + r)  # rank 1's layer is wider
    errors = []
    try:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    except hvd.TensorMismatchError as err:
        errors.append(str(err))
    # (its hooks send each gradient: the mismatch shows in backward)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=model.named_parameters())
    try:
        model(torch.ones(3, 4)).sum().backward()
    except hvd.TensorMismatchError as err:
        errors.append(str(err))
    hvd.shutdown()
    return errors


def test_mismatched_models_raise_on_every_rank() -> None:
    for r, errors in enumerate(run_ranks(2, body_mismatched_models, timeout=90)):
        assert len(errors) == 2, errors
        assert "broadcast 'parameter.bias'" in errors[0] and "mismatched shapes" in errors[0]
        assert "allreduce" in errors[1] and "mismatched shapes" in errors[1]


def body_sparse_embedding() -> torch.Tensor:
    hvd.init(timeout=30)
    r = hvd.rank()
    torch.manual_seed(0)
    table = nn.Embedding(6, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(table.parameters(), lr=1.0),
                                   named_parameters=table.named_parameters())
    table(torch.tensor([r, 5])).sum().backward()  # rank r touches rows r and 5
    opt.step()
    hvd.shutdown()
    return table.weight.detach()


def test_sparse_gradients_are_averaged_dense() -> None:
    torch.manual_seed(0)
    start = nn.Embedding(6, 2).weight.detach()
    got = run_ranks(2, body_sparse_embedding, timeout=90)
    want = start.clone()
    want[0] -= 0.5
    want[1] -= 0.5
    want[5] -= 1.0
    assert torch.allclose(got[0], want) and torch.allclose(got[1], want)


def body_zero_grad_while_accumulating() -> dict[str, object]:
    """zero_grad() between the passes of backward_passes_per_step=2 raises, as in Horovod (it
    used to drop the first pass's gradient silently)."""
    hvd.init(timeout=30)
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    out: dict[str, object] = {}
    model(torch.tensor([[1.0]])).sum().backward()  # pass 1: gradient 1, kept locally
    try:
        opt.zero_grad()
    except RuntimeError as err:
        out["error"] = str(err)
    model(torch.tensor([[10.0]])).sum().backward()  # pass 2: gradient 10, then the allreduce
    opt.step()
    opt.zero_grad()  # after step() it is allowed again
    out["weight"] = model.weight.item()
    hvd.shutdown()
    return out


def test_zero_grad_between_accumulation_passes_raises() -> None:
    for got in run_ranks(2, body_zero_grad_while_accumulating, timeout=60):
        assert "before optimizer.step() or optimizer.synchronize()" in got.get("error", ""), got
        assert got["weight"] == -11.0, got  # both passes' gradients, averaged over equal ranks


def body_optimizer_outside_its_process_set() -> dict[str, object]:
    """Ranks 0 and 1 average over their set; rank 2, outside it, steps on its own gradient,
    as in Horovod (its gradient hook used to raise "not a member")."""
    hvd.init(timeout=30)
    r = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=pair)
    for _ in range(2):
        opt.zero_grad()
        model(torch.tensor([[r + 1.0]])).sum().backward()  # gradient r + 1
        opt.step()
    out: dict[str, object] = {"weight": model.weight.item()}
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                 process_set=hvd.ProcessSet([0, 2]))
    except NotInitialized as err:
        out["unregistered"] = str(err)
    hvd.shutdown()
    return out


def test_optimizer_steps_locally_outside_its_process_set() -> None:
    got = run_ranks(3, body_optimizer_outside_its_process_set, timeout=90)
    assert [g["weight"] for g in got] == [-3.0, -3.0, -6.0], got  # 2 steps of 1.5, 1.5, 3
    assert all("not registered" in g.get("unregistered", "") for g in got), got


def body_broadcast_parameter_lists() -> list[object]:
    """broadcast_parameters takes model.parameters() as a list, as Horovod does (it used to
    raise ValueError), as well as (name, tensor) pairs."""
    hvd.init(timeout=30)
    r = hvd.rank()
    model = _model(seed=r)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    plain = [p.detach().clone() for p in model.parameters()]
    other = _model(seed=10 + r)
    hvd.broadcast_parameters(list(other.named_parameters()), root_rank=1)
    errors = []
    try:
        hvd.broadcast_parameters([("w", torch.ones(1), 3)], root_rank=0)
    except ValueError as err:
        errors.append(str(err))
    hvd.shutdown()
    return [plain, [p.detach() for p in other.parameters()], errors]


def test_broadcast_parameters_takes_a_list_of_parameters() -> None:
    got = run_ranks(2, body_broadcast_parameter_lists, timeout=60)
    for index, root_model in ((0, _model(seed=0)), (1, _model(seed=11))):  # roots 0 and 1
        want = [p.detach() for p in root_model.parameters()]
        for rank_got in got:
            assert all(torch.equal(g, w) for g, w in zip(rank_got[index], want, strict=True))
    for rank_got in got:
        assert len(rank_got[2]) == 1 and "a tuple of 3 items" in rank_got[2][0], rank_got[2]
