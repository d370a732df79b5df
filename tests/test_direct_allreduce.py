"""Small allreduces over gloo in one exchange (scaleout.core.direct): the path really taken,
results equal bit for bit on every rank and to the rank-order reduction, gloo's ring above
the bound or when turned off, and ranks that disagree on the setting get an error."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist

import scaleout
from harness import run_ranks
from scaleout import ReduceOp
from scaleout.core import collectives, direct


def _inputs(world: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's tensor (the same on all ranks: each rank takes its own)."""
    gen = torch.Generator().manual_seed(numel)
    return [(torch.randn(numel, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
            for _ in range(world)]


def body_direct(numel: int) -> list[bool]:
    env = scaleout.init(timeout=30)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    world, rank = env.world_size, env.rank

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("gloo's all_reduce ran for a tensor under the bound")

    taken = []
    ring = tdist.all_reduce
    tdist.all_reduce = refuse  # (collectives reads it from the module at each call)
    try:
        for dtype, op in [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG),
                          (torch.float64, ReduceOp.MAX), (torch.int64, ReduceOp.MIN),
                          (torch.bfloat16, ReduceOp.SUM)]:
            xs = _inputs(world, numel, dtype)
            x = xs[rank].clone()
            taken.append(direct.applies(comm.group, x, world))
            assert collectives.allreduce(comm, x, op).wait() is x
            if op in (ReduceOp.SUM, ReduceOp.AVG):
                want = xs[0] + xs[1]
                for other in xs[2:]:
                    want = want + other
                if op is ReduceOp.AVG:
                    want = want / world
            else:
                want = torch.stack(xs).amax(0) if op is ReduceOp.MAX else torch.stack(xs).amin(0)
            assert torch.equal(x, want), (dtype, op, (x.double() - want.double()).abs().max())
            everyone = [torch.empty_like(x) for _ in range(world)]
            tdist.all_gather(everyone, x)
            assert all(torch.equal(other, x) for other in everyone), (dtype, op)
    finally:
        tdist.all_reduce = ring
    env.finalize()
    return taken


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_allreduce_is_one_exchange_equal_on_every_rank(world: int) -> None:
    """Under the bounds gloo's allreduce is never called, and every rank holds the
    rank-order reduction, bit for bit."""
    sizes = [1, 1000, direct.MAX_BYTES[world] // 8]  # (int64 and float64: at the bound)
    for numel in sizes:
        assert run_ranks(world, body_direct, numel, timeout=60) == [[True] * 5] * world


def body_ring(numel: int, off: bool) -> int:
    if off:
        os.environ[direct.ENV_VAR] = "0"
    env = scaleout.init(timeout=30)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    calls = []
    ring = tdist.all_reduce

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return ring(*args, **kwargs)

    tdist.all_reduce = counted
    try:
        x = torch.full((numel,), float(env.rank + 1))
        collectives.allreduce(comm, x).wait()
        assert torch.equal(x, torch.full((numel,), float(sum(range(1, env.world_size + 1)))))
    finally:
        tdist.all_reduce = ring
    env.finalize()
    return len(calls)


def test_above_the_bound_or_turned_off_gloo_reduces() -> None:
    """The bound by group size (none from 4 ranks: gloo's ring), and the setting."""
    for world, bound in direct.MAX_BYTES.items():
        assert run_ranks(world, body_ring, bound // 4, False, timeout=60) == [0] * world
        assert run_ranks(world, body_ring, bound // 4 + 1, False, timeout=60) == [1] * world
    assert run_ranks(4, body_ring, 1, False, timeout=60) == [1] * 4
    assert run_ranks(2, body_ring, 100, True, timeout=60) == [1] * 2


def test_only_cpu_tensors_of_real_or_integer_dtypes_on_gloo_groups() -> None:
    assert not direct.applies(None, torch.ones(4), 2)  # not a process group
    assert not direct.applies(None, torch.ones(4, device="meta"), 2)
    assert not direct.applies(None, torch.ones(4, dtype=torch.bool), 2)
    assert not direct.applies(None, torch.ones(4, dtype=torch.complex64), 2)
    assert not direct.applies(None, torch.ones(4), 1)


def body_setting_differs() -> str:
    env = scaleout.init(timeout=20)
    comm = env.create_distribution().communicator(scaleout.GroupType.DATA)
    os.environ[direct.ENV_VAR] = "0" if env.rank == 1 else "1"  # as a launch that lost it
    with pytest.raises(ValueError, match="direct_allreduce=off") as caught:
        collectives.allreduce(comm, torch.zeros(10)).wait()
    env.finalize()
    return str(caught.value)


def test_ranks_with_different_settings_get_an_error_not_a_hang() -> None:
    for message in run_ranks(2, body_setting_differs, timeout=60):
        assert "rank 0: allreduce(float32, shape (10,), SUM); rank 1: allreduce(float32, " \
            "shape (10,), SUM, direct_allreduce=off)" in message, message
