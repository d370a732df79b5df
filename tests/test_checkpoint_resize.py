"""A checkpoint taken at N ranks loads at M ranks: exact paths and the sharded update continue
as if never interrupted (the oracle: one process on the whole batch); codec residuals are reset
with a warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import checkpoint
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.pytorch.resharding import consolidate_optimizer_state, split_optimizer_state

BATCH = 12  # the global batch: 6 per rank at 2 ranks, 4 at 3
KINDS = ("exact", "sharded", "topk")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 10, generator=gen), torch.randn(BATCH, 3, generator=gen)


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sharded":  # Adam: per-element moments and a scalar step per parameter
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def body_phase(folder: str, first: int, last: int) -> dict[str, list[str]]:
    from scaleout.compression import CompressionConfig
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    topk = CompressionConfig(codec="topk:ratio=0.3", min_numel=16)  # every layer compressed
    per = BATCH // env.world_size
    caught: dict[str, list[str]] = {}
    for kind in KINDS:
        net = network()
        model = DataParallel(net, distributed_update=kind == "sharded",
                             compression=topk if kind == "topk" else None)
        opt = DistributedOptimizer(optimizer(kind, net.parameters()), model)
        if first:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                step, _ = checkpoint.load(f"{folder}/{kind}", model, opt)
            assert step == first
            caught[kind] = [str(w.message) for w in seen]
        for step in range(first, last):
            x, y = batch(step)
            mine = slice(env.rank * per, (env.rank + 1) * per)
            (model(x[mine]) - y[mine]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(f"{folder}/{kind}", model, opt, step=last)
        model.close()
    env.finalize()
    return caught


def reference(kind: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process, the whole batch: what N-rank training equals."""
    net = network()
    opt = optimizer(kind, net.parameters())
    for step in range(steps):
        x, y = batch(step)
        (net(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_resume_at_another_world_size(tmp_path: Path, before: int, after: int) -> None:
    assert run_ranks(before, body_phase, str(tmp_path), 0, 3, timeout=90) == [{}] * before
    caught = run_ranks(after, body_phase, str(tmp_path), 3, 6, timeout=90)
    for kind in ("exact", "sharded"):
        net, opt = reference(kind, 6)
        saved = checkpoint.consolidate(tmp_path / kind)
        assert saved["step"] == 6 and saved["world_size"] == after
        for name, value in net.state_dict().items():  # float summation order only
            torch.testing.assert_close(saved["model"][f"module.{name}"], value,
                                       rtol=1e-5, atol=1e-6)
        expected = opt.state_dict()["state"]
        assert sorted(saved["optimizer"]["state"]) == sorted(expected)
        for index, entry in expected.items():
            for key, value in entry.items():
                torch.testing.assert_close(saved["optimizer"]["state"][index][key], value,
                                           rtol=1e-4, atol=1e-7)
    for rank, seen in enumerate(caught):
        assert seen["exact"] == [] and seen["sharded"] == [], (rank, seen)
        assert len(seen["topk"]) == 1, (rank, seen)
        assert f"saved at {before} ranks, loaded at {after}" in seen["topk"][0]
        assert "is reset" in seen["topk"][0]


def test_sharded_state_splits_and_joins_at_any_size() -> None:
    shapes = [(7,), (2, 3), (2,), ()]
    gen = torch.Generator().manual_seed(0)
    full = {"state": {i: {"exp_avg": torch.randn(s, generator=gen), "step": torch.tensor(4.0)}
                      for i, s in enumerate(shapes)},
            "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}
    for size in (1, 2, 3, 4, 5):
        parts = [split_optimizer_state(full, shapes, size, r) for r in range(size)]
        assert sum(p["state"][0]["exp_avg"].numel() for p in parts) == 7
        # a 0-dim parameter's moment is 0-dim like its step: it was kept whole on every
        # rank, and the first step after the load failed ("output with shape []")
        assert [p["state"][3]["exp_avg"].shape for p in parts] == \
            [(1,)] + [(0,)] * (size - 1)
        assert all(p["state"][3]["step"].shape == () for p in parts)
        joined = consolidate_optimizer_state(parts, shapes)
        assert joined["param_groups"] == full["param_groups"]
        for index, entry in full["state"].items():
            for key, value in entry.items():
                assert torch.equal(joined["state"][index][key], value), (size, index, key)
    parts = [split_optimizer_state(full, shapes, 2, r) for r in range(2)]
    parts[1]["state"][0]["step"] = torch.tensor(5.0)
    with pytest.raises(ValueError, match="differs between ranks"):
        consolidate_optimizer_state(parts, shapes)
    parts[1]["state"][0]["step"] = torch.tensor(4.0)
    del parts[1]["state"][2]
    with pytest.raises(ValueError, match="missing on ranks"):
        consolidate_optimizer_state(parts, shapes)


def test_what_cannot_be_repartitioned_is_refused(tmp_path: Path) -> None:
    """A rank-local (or tensor-parallel) parameter differs by rank: no other world size; a
    plain model saved in one process consolidates (the optimizer state as it was)."""
    from scaleout.pytorch.placement import Kind, Placement, place

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "plain", model, opt, step=1)
    whole = checkpoint.consolidate(tmp_path / "plain")
    assert whole["world_size"] == 1 and whole["step"] == 1
    assert torch.equal(whole["optimizer"]["state"][0]["momentum_buffer"],
                       opt.state[model.weight]["momentum_buffer"])
    place(model.weight, Placement(kind=Kind.LOCAL, layer="table"))
    checkpoint.save(tmp_path / "local", model, opt, step=1)
    with pytest.raises(ValueError, match="rank-local parameters"):
        checkpoint.consolidate(tmp_path / "local")
    assert checkpoint.load(tmp_path / "local", model, opt) == (1, {})  # same world size: fine


def body_tensor_parallel(path: str, grid: tuple[int, int], save_it: bool,
                         sharded: bool = False) -> str:
    from scaleout.pytorch import tensor_parallel

    env = scaleout.init(timeout=30)
    dist = env.create_distribution(*grid)
    torch.manual_seed(0)
    net = tensor_parallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), dist)
    model = DataParallel(net, dist, distributed_update=sharded)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    try:
        if save_it:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            checkpoint.save(path, model, opt, step=1)
            outcome = "saved"
        else:
            checkpoint.load(path, model, opt)
            outcome = "loaded"
    except ValueError as err:
        outcome = str(err)
    model.close()
    env.finalize()
    return outcome


def test_a_tensor_parallel_checkpoint_names_the_grid_it_needs(tmp_path: Path) -> None:
    """Saved on a 1x2 grid: it loads there; on 2x1 (same world size) it was torch's raw
    "size mismatch"."""
    path = str(tmp_path / "tp")
    assert run_ranks(2, body_tensor_parallel, path, (1, 2), True) == ["saved"] * 2
    assert run_ranks(2, body_tensor_parallel, path, (1, 2), False) == ["loaded"] * 2
    for world, grid in ((2, (2, 1)), (1, (1, 1))):
        for outcome in run_ranks(world, body_tensor_parallel, path, grid, False):
            assert "split over model groups of 2: it loads only on such a grid, not on model " \
                   "groups of 1" in outcome, outcome
    # the same grid with the sharded update on: it said "loads only at world size 2", at 2
    for outcome in run_ranks(2, body_tensor_parallel, path, (1, 2), False, True):
        assert "saved without a sharded update; it loads only with that sharding, not with a " \
               "sharded update over 1 rank (set distributed_update" in outcome, outcome


def test_every_scalar_in_a_sharded_optimizers_state_is_named() -> None:
    # a 0-dim parameter's state is told apart from the optimizer's scalars by name only
    from scaleout.pytorch.resharding import SCALAR_STATE
    from scaleout.pytorch.sharded_update import ELEMENTWISE

    for cls in ELEMENTWISE:
        p = nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        scalars = {k for k, v in opt.state[p].items() if not torch.is_tensor(v) or v.dim() == 0}
        assert scalars <= SCALAR_STATE, (cls.__name__, scalars)
