"""Every collective, on every group type, against a NumPy oracle, at world sizes 1, 2, 3 (and 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import scaleout
from harness import run_ranks
from scaleout import GroupType, ReduceOp

# (world size, data_parts, model_parts): odd sizes, model groups, and independent replicas.
GRIDS = [(1, 1, 1), (2, 2, 1), (2, 1, 2), (3, 3, 1), (3, 1, 3), (3, 1, 1), (4, 2, 2)]
OPS = ["allreduce", "reduce", "bcast", "allgather", "allgatherv", "gather", "scatter",
       "reduce_scatter", "alltoall", "alltoallv", "barrier"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def base(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64) % 7 + 3 * rank + 1).reshape(shape)


def _np_reduce(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(arrays)
    return {ReduceOp.SUM: stack.sum(0), ReduceOp.MIN: stack.min(0), ReduceOp.MAX: stack.max(0),
            ReduceOp.AVG: stack.mean(0)}[op]


def check_op(op_name: str, d: scaleout.Distribution, group: GroupType) -> None:
    members = d.ranks(group)
    size, me, rank = len(members), d.rank(group), members[d.rank(group)]

    def t(array: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)

    def same(got: torch.Tensor, want: np.ndarray) -> None:
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-2 if got.element_size() == 2 else 1e-6)

    if op_name == "allreduce":
        for dtype in DTYPES:
            for op in ReduceOp:
                if op is ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                x = t(base(rank, (3, 5)), dtype)
                out = d.allreduce(x, op, group=group).wait()
                assert out is x and out.dtype == dtype
                same(out, _np_reduce([base(r, (3, 5)) for r in members], op))
        # non-contiguous input is reduced in place too
        x = t(base(rank, (4, 6))).t()
        d.allreduce(x, group=group).wait()
        same(x, _np_reduce([base(r, (4, 6)).T for r in members], ReduceOp.SUM))
    elif op_name == "reduce":
        root = size - 1
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
            x = t(base(rank, (7,)), torch.float64)
            out = d.reduce(x, root, op, group=group).wait()
            if me == root:
                same(out, _np_reduce([base(r, (7,)) for r in members], op))
    elif op_name == "bcast":
        root = size - 1
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            x = t(base(rank, (2, 3)), dtype)
            same(d.bcast(x, root, group=group).wait(), base(members[root], (2, 3)))
    elif op_name == "allgather":
        out = d.allgather(t(base(rank, (2, 3))), group=group).wait()
        same(out, np.concatenate([base(r, (2, 3)) for r in members]))
        scalar = d.allgather(torch.tensor(float(rank)), group=group).wait()
        same(scalar, np.array(members, dtype=np.float64))
    elif op_name == "allgatherv":
        counts = [i + 1 for i in range(size)]
        out = d.allgatherv(t(base(rank, (counts[me], 2)), torch.int32), counts, group=group).wait()
        same(out, np.concatenate([base(r, (counts[i], 2)) for i, r in enumerate(members)]))
        zeros = [0] * size
        zeros[0] = 2
        out = d.allgatherv(t(base(rank, (zeros[me], 3))), zeros, group=group).wait()
        same(out, base(members[0], (2, 3)))
    elif op_name == "gather":
        out = d.gather(t(base(rank, (2, 2))), 0, group=group).wait()
        if me == 0:
            same(out, np.concatenate([base(r, (2, 2)) for r in members]))
        else:
            assert out is None
    elif op_name == "scatter":
        root = size - 1
        out = d.scatter(t(base(rank, (size * 2, 3))), root, group=group).wait()
        same(out, base(members[root], (size * 2, 3))[me * 2:(me + 1) * 2])
    elif op_name == "reduce_scatter":
        for op in ReduceOp:
            out = d.reduce_scatter(t(base(rank, (size * 3,)), torch.float64), op, group=group).wait()
            total = _np_reduce([base(r, (size * 3,)) for r in members], op)
            same(out, total[me * 3:(me + 1) * 3])
        # into this rank's own block of the input (in place), and an integer dtype
        x = t(base(rank, (size * 2, 3)), torch.int64)
        mine = x[me * 2:(me + 1) * 2]
        assert d.reduce_scatter(x, ReduceOp.SUM, group=group, out=mine).wait() is mine
        same(mine, _np_reduce([base(r, (size * 2, 3)) for r in members], ReduceOp.SUM)[me * 2:(me + 1) * 2])
    elif op_name == "alltoall":
        def data(r: int) -> np.ndarray:
            return base(r, (size * 2, 2)) + 100 * np.arange(size * 2)[:, None]
        out = d.alltoall(t(data(rank)), group=group).wait()
        want = np.concatenate([data(r)[me * 2:(me + 1) * 2] for r in members])
        same(out, want)
    elif op_name == "alltoallv":
        def rows(i: int, j: int) -> np.ndarray:  # what group rank i sends to group rank j
            n = i + 2 * j + 1
            return (1000 * members[i] + 10 * j + np.arange(n, dtype=np.float64))[:, None] * [1, -1]
        send = np.concatenate([rows(me, j) for j in range(size)])
        send_counts = [me + 2 * j + 1 for j in range(size)]
        recv_counts = [i + 2 * me + 1 for i in range(size)]
        out = d.alltoallv(t(send, torch.int64), send_counts, recv_counts, group=group).wait()
        same(out, np.concatenate([rows(i, me) for i in range(size)]))
    elif op_name == "barrier":
        d.barrier(group=group)
    else:
        raise AssertionError(op_name)


def body_all_groups(op_names: list[str], data_parts: int, model_parts: int) -> list[str]:
    """Every collective of ``op_names`` in turn on every group type, in one job (each job
    is a start-up: fork, rendezvous, groups; about 0.2 s, more than its collectives)."""
    env = scaleout.init(timeout=30)
    d = env.create_distribution(data_parts, model_parts)
    for op_name in op_names:
        for group in GroupType:
            # a group of one (of several ranks) holds no process group: its calls complete
            alone = d.size(group) == 1 and env.world_size > 1  # at once
            assert (d.communicator(group).group is None) == alone, group
            try:
                check_op(op_name, d, group)
            except AssertionError as err:
                raise AssertionError(f"{op_name} on group {group.name}: {err}") from err
    # non-blocking: test() eventually says complete, then wait() returns at once
    req = d.allreduce(torch.ones(1000), group=GroupType.GLOBAL)
    while not req.test():
        pass
    assert torch.all(req.wait() == d.size(GroupType.GLOBAL))
    env.finalize()
    return [g.name for g in GroupType]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"w{g[0]}-d{g[1]}xm{g[2]}")
def test_collective_matches_oracle(grid: tuple[int, int, int]) -> None:
    """Every collective of OPS (one after the other in the same job)."""
    world, data_parts, model_parts = grid
    run_ranks(world, body_all_groups, OPS, data_parts, model_parts, timeout=90)


def body_groups(data_parts: int, model_parts: int) -> dict[str, tuple[int, ...]]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(data_parts, model_parts)
    layout = {g.value: d.ranks(g) for g in GroupType}
    assert d.rank(GroupType.GLOBAL) == layout["global"].index(env.rank)
    env.finalize()
    return layout


def test_grid_layout_is_mlsl() -> None:
    layouts = run_ranks(4, body_groups, 2, 2, timeout=60)
    assert [lay["model"] for lay in layouts] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [lay["data"] for lay in layouts] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all(lay["global"] == (0, 1, 2, 3) for lay in layouts)


def body_out_buffers() -> None:
    env = scaleout.init(timeout=30)
    d = env.create_distribution()
    g, size = GroupType.DATA, env.world_size
    out = torch.full((size * 2, 3), -1.0)
    got = d.allgather(torch.full((2, 3), float(env.rank)), group=g, out=out).wait()
    assert got is out and torch.equal(out[::2, 0], torch.arange(size, dtype=torch.float32))
    shard = torch.empty(2)
    assert d.reduce_scatter(torch.ones(2 * size), group=g, out=shard).wait() is shard
    assert torch.equal(shard, torch.full((2,), float(size)))
    buf = torch.empty(size * 2)
    assert d.alltoall(torch.arange(size * 2.0), group=g, out=buf).wait() is buf
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of shape \(4, 3\)"):
        d.allgather(torch.ones(2, 3), group=g, out=torch.empty(5, 3))
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        d.alltoall(torch.ones(2 * size), group=g, out=torch.empty(2 * size, dtype=torch.int64))
    # an out over the tensor sent was overwritten while it was sent: wrong blocks came back
    both = torch.arange(4.0 * size)
    with pytest.raises(ValueError, match="alltoall: out must not overlap the tensor sent"):
        d.alltoall(both[:2 * size], group=g, out=both[:2 * size])
    with pytest.raises(ValueError, match="alltoallv: out must not overlap"):
        d.alltoallv(both[:2 * size], [2] * size, [2] * size, group=g, out=both[1:2 * size + 1])
    with pytest.raises(ValueError, match="scatter: out must not overlap"):
        d.scatter(both[:2 * size], 0, group=g, out=both[:2])
    assert d.alltoall(both[:2 * size], group=g, out=both[2 * size:]).wait() is not None
    # a tensor that requires grad (a Parameter): collectives work below autograd, as torch's
    # (a small all-reduce raised after its exchange, AVG always, an allgather timed out)
    for numel in (4, 40_000):
        param = torch.nn.Parameter(torch.full((numel,), float(env.rank + 1)))
        d.allreduce(param, ReduceOp.AVG, group=g).wait()
        assert torch.equal(param.detach(), torch.full((numel,), (size + 1) / 2))
    gathered = d.allgather(torch.ones(2, requires_grad=True), group=g).wait()
    assert gathered.shape == (2 * size,) and not gathered.requires_grad
    # an empty tensor: the root split it into one part, not one per rank (gloo refused it)
    assert d.scatter(torch.empty(0, 3), 0, group=g).wait().shape == (0, 3)
    env.finalize()


def test_results_into_caller_buffers() -> None:
    run_ranks(2, body_out_buffers, timeout=60)
