"""Random numbers inside split regions: a stream of its own on each rank of a model group.

A dropout between a column and a row layer (or on an attention's split heads, or on a
spatial split's rows) acts on each rank's block of the activation; before stop 49 it drew
the same mask on every rank of the model group (unit ``j`` of rank 0 and unit ``j + n/p`` of
rank 1 kept or dropped together: 100% agreement). The converters now put such dropouts on a
:class:`ModelParallelRNG` stream: about 50% agreement, as independent masks, while dropouts
on replicated activations still draw the same mask everywhere.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import cuda_available, run_ranks
from scaleout import GroupType
from scaleout.pytorch import (
    DataParallel,
    ModelParallelRNG,
    SplitRegionDropout,
    full_state_dict,
    spatial_parallel,
    tensor_parallel,
)
from scaleout.pytorch.model_rng import split_seed
from scaleout.pytorch.tensor_parallel import plan_tensor_parallel
from scaleout.pytorch.split_regions import split_dropouts, tensor_parallel_dropouts

ROWS, P = 256, 0.5


class Attention(nn.Module):
    """nanoGPT's attention: a dropout on the (split) heads' weights, one after the output
    projection (replicated)."""

    def __init__(self, width: int = 8, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.attn_dropout, self.resid_dropout = nn.Dropout(P), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.size()
        q, k, v = (self.q(x).view(batch, seq, self.n_head, -1).transpose(1, 2),
                   self.k(x).view(batch, seq, self.n_head, -1).transpose(1, 2),
                   self.v(x).view(batch, seq, self.n_head, -1).transpose(1, 2))
        att = self.attn_dropout(F.softmax(q @ k.transpose(-2, -1) / k.size(-1) ** 0.5, dim=-1))
        return self.resid_dropout(self.out((att @ v).transpose(1, 2).reshape(batch, seq, -1)))


def mlp() -> nn.Sequential:
    """A dropout on the hidden units (split), one after the row layer (replicated)."""
    return nn.Sequential(nn.Linear(16, 48), nn.Dropout(P), nn.Linear(48, 16), nn.Dropout(P))


def capture(model: nn.Module, names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Each named dropout's kept units at every call (its input is never exactly zero)."""
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda _m, args, out, n=name: kept[n].append((out != 0) | (args[0] == 0)))
    return kept


def body_masks(check: str) -> dict[str, object]:
    env = scaleout.init(timeout=30, check_consistency=check)
    dist = env.create_distribution(1, env.world_size)
    torch.manual_seed(0)
    net = tensor_parallel(nn.ModuleDict({"mlp": mlp(), "attn": Attention()}), dist)
    kept = capture(net, ["mlp.1", "mlp.3", "attn.attn_dropout", "attn.resid_dropout"])
    for _ in range(2):
        net["mlp"](torch.rand(ROWS, 16) + 1.0)
        net["attn"](torch.randn(ROWS // 4, 8, 8))
    after = torch.rand(3)  # the default stream, after the split regions drew from theirs
    types = {n: type(net.get_submodule(n)).__name__ for n in kept}
    env.finalize()
    return {"kept": kept, "after": after, "types": types}


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def test_masks_in_split_regions_differ_across_model_ranks_and_agree_elsewhere() -> None:
    ranks = run_ranks(2, body_masks, "full")  # "full": the replicated inputs are compared
    first, second = ranks
    assert first["types"] == {"mlp.1": "SplitRegionDropout", "mlp.3": "Dropout",
                              "attn.attn_dropout": "SplitRegionDropout",
                              "attn.resid_dropout": "Dropout"}
    for name in ("mlp.1", "attn.attn_dropout"):  # each rank's block: independent masks
        for step in range(2):
            mine, other = first["kept"][name][step], second["kept"][name][step]
            # before stop 49: 1.0 (the same draws on every rank's block)
            assert 0.45 < agreement(mine, other) < 0.55, (name, step, agreement(mine, other))
            for kept in (mine, other):  # (kept with probability 1 - p: unbiased)
                assert abs(kept.float().mean().item() - (1 - P)) < 0.05, (name, step)
        # the stream goes on: the second step's masks are fresh
        assert 0.45 < agreement(*first["kept"][name]) < 0.55
    for name in ("mlp.3", "attn.resid_dropout"):  # replicated: the same mask everywhere
        for step in range(2):
            assert torch.equal(first["kept"][name][step], second["kept"][name][step]), name
    assert torch.equal(first["after"], second["after"])


def body_training(grid: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
    env = scaleout.init(timeout=60, check_consistency="full")
    dist = env.create_distribution(*grid)
    runs = []
    for _ in range(2):  # the same seeds: the same training
        torch.manual_seed(0)
        net = tensor_parallel(mlp().double(), dist)
        model = DataParallel(net, dist)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(100 + dist.rank(GroupType.DATA))  # the ranks of a model group alike
        for step in range(3):
            x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(
                10 * step + dist.rank(GroupType.DATA)))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()
        runs.append({**full_state_dict(net), "replicated bias": net[2].bias.detach().clone()})
        model.close()
    env.finalize()
    return runs


@pytest.mark.parametrize("grid", [(1, 2), (1, 3)])
def test_training_with_split_dropouts_is_deterministic(grid: tuple[int, int]) -> None:
    ranks = run_ranks(grid[0] * grid[1], body_training, grid, timeout=90)
    for rank, (one, two) in enumerate(ranks):
        for name, value in one.items():
            assert torch.equal(value, two[name]), (rank, name)
        # the replicated bias trained alike on every model rank (no drift)
        assert torch.equal(one["replicated bias"], ranks[0][0]["replicated bias"]), rank


class CNN(nn.Module):
    """Dropouts on split rows (elementwise, and a channel dropout) and in the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.drop, self.channels = nn.Dropout(P), nn.Dropout2d(P)
        self.pool, self.fc, self.head_drop = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 8), \
            nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.channels(self.conv2(F.relu(self.drop(self.conv1(x)))))
        return self.head_drop(self.fc(self.pool(h).flatten(1)))


def body_spatial() -> dict[str, object]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, 2)
    net = spatial_parallel(CNN(), dist)
    kept = capture(net, ["drop", "channels", "head_drop"])
    torch.manual_seed(1)
    x = torch.rand(16, 2, 12, 6) + 1.0
    # blocks of 5 and 7 rows: before stop 49 the split rows' dropout drew 5 rows' numbers on
    # one rank and 7 on the other from the default stream, and the head's masks parted
    block = x[:, :, :5] if env.rank == 0 else x[:, :, 5:]
    net(block)
    types = {n: type(net.get_submodule(n)).__name__ for n in kept}
    env.finalize()
    return {"kept": kept, "types": types}


def test_dropouts_on_split_rows_draw_per_rank_and_the_head_alike() -> None:
    first, second = run_ranks(2, body_spatial)
    assert first["types"] == {"drop": "SplitRegionDropout", "channels": "Dropout2d",
                              "head_drop": "Dropout"}
    rows = first["kept"]["drop"][0], second["kept"]["drop"][0][:, :, :5]
    assert 0.45 < agreement(*rows) < 0.55, agreement(*rows)
    channels = first["kept"]["channels"][0], second["kept"]["channels"][0]
    assert torch.equal(channels[0][:, :, 0, 0], channels[1][:, :, 0, 0])  # whole channels
    assert torch.equal(first["kept"]["head_drop"][0], second["kept"]["head_drop"][0])


def body_stream() -> dict[str, object]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, env.world_size)
    rng = ModelParallelRNG(dist)
    draws = []
    for seed in (5, 5, 6):  # 6: a data replica seeded 5 + its data rank
        torch.manual_seed(seed)
        with rng.fork():
            first = torch.rand(4)
        with rng.fork(torch.device("cpu")):
            draws.append((first, torch.rand(4)))
    torch.manual_seed(5)
    with rng.fork("cpu"):
        nested = [torch.rand(4)]
        with rng.fork():  # inside a fork: the same stream goes on
            nested.append(torch.rand(4))
    torch.manual_seed(5)
    with rng.fork("cpu"):
        continued = torch.rand(8)
    outside = torch.rand(4)
    errors = []
    for bad in (lambda: ModelParallelRNG("grid"), lambda: rng.fork(3).__enter__(),
                lambda: SplitRegionDropout(0.1, rng=None),
                lambda: SplitRegionDropout(1.5, rng=rng)):
        try:
            bad()
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    env.finalize()
    return {"draws": draws, "nested": torch.cat(nested), "continued": continued,
            "outside": outside, "errors": errors}


def test_forks_draw_fresh_per_rank_numbers_reproducibly() -> None:
    first, second = run_ranks(2, body_stream)
    (one, two), (again, again_two), (replica, _) = first["draws"]
    assert not torch.equal(one, two)  # each fork: fresh numbers
    assert torch.equal(one, again) and torch.equal(two, again_two)  # same seed, same numbers
    assert torch.equal(first["nested"], first["continued"])
    assert torch.equal(first["continued"][:4], one)
    assert not torch.equal(replica, one)  # another data replica's seed: other numbers
    for mine, other in zip(first["draws"], second["draws"]):  # another model rank: other
        assert not torch.equal(mine[0], other[0]) and not torch.equal(mine[1], other[1])
    assert torch.equal(first["outside"], second["outside"])  # the default stream: alike
    expected = ["TypeError: ModelParallelRNG: distribution must be a scaleout.Distribution",
                "TypeError: ModelParallelRNG.fork: device must be a torch.device",
                "TypeError: SplitRegionDropout: rng must be a ModelParallelRNG",
                "ValueError: dropout probability has to be between 0 and 1"]
    assert len(first["errors"]) == len(expected), first["errors"]
    for error, start in zip(first["errors"], expected):
        assert error.startswith(start), (error, start)


def body_checkpointed() -> float:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, env.world_size)
    torch.manual_seed(0)
    net = tensor_parallel(mlp().double(), dist)
    x = torch.randn(32, 16, dtype=torch.float64)
    grads = []
    for run in (net, lambda v: torch.utils.checkpoint.checkpoint(net, v, use_reentrant=False)):
        torch.manual_seed(1)
        run(x).square().sum().backward()
        grads.append(net[0].weight.grad.clone())
        net.zero_grad()
    env.finalize()
    return (grads[0] - grads[1]).abs().max().item()


def test_activation_checkpointing_recomputes_the_same_masks() -> None:
    # torch's checkpoint replays the default CPU generator, and with it each fork's numbers:
    # a stream kept across forks (Megatron's tracker) recomputed other masks (gradients off
    # by 10-23 on this MLP, measured at stop 49)
    assert run_ranks(2, body_checkpointed) == [0.0, 0.0]


def body_alone() -> tuple[torch.Tensor, torch.Tensor, str]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, 1)
    torch.manual_seed(3)
    net = tensor_parallel(mlp(), dist)
    torch.manual_seed(4)  # (the conversion draws: its layers are initialised, then copied)
    with ModelParallelRNG(dist).fork():
        drawn = torch.rand(4)
    out = net(torch.ones(2, 16))
    env.finalize()
    return drawn, out, type(net[1]).__name__


def test_a_model_group_of_one_draws_as_the_plain_model() -> None:
    drawn, out, kind = run_ranks(1, body_alone)[0]
    torch.manual_seed(3)
    plain = mlp()
    torch.manual_seed(4)
    assert torch.equal(drawn, torch.rand(4)) and kind == "Dropout"
    assert torch.equal(out, plain(torch.ones(2, 16)))


def test_split_seeds_do_not_collide() -> None:
    seeds = {split_seed(base, rank) for base in range(64) for rank in range(64)}
    assert len(seeds) == 64 * 64 and all(0 <= s < 2**64 for s in seeds)


def test_the_dropouts_found_in_split_regions() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.drop = Attention(), nn.Dropout(P)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(P),
                                     nn.Linear(16, 8), nn.Dropout(P))
            self.fc, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.mlp(x + self.attn(x))
            return self.drop(self.fc2(self.drop(self.fc(x))))  # one dropout, both regions

    block = Block()
    plan = plan_tensor_parallel(block)
    assert plan["fc"] == "column" and plan["attn.q"] == "column" and plan["mlp.0"] == "column"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tensor_parallel_dropouts(block, plan) == ["attn.attn_dropout", "mlp.2"]
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)  # not traceable
        assert tensor_parallel_dropouts(layer, {"linear1": "column", "linear2": "row"}) == []
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "<root> (Block) calls drop on split and on whole activations" in messages[0]
    assert "the forward of <root> (TransformerEncoderLayer) cannot be traced" in messages[1]
    cnn = CNN()  # spatial: from a spatial layer to the global pool; no channel dropout
    assert split_dropouts(cnn, {"conv1", "conv2"}, {"pool"}, caller="test") == ["drop"]


def body_cuda() -> tuple[bool, torch.Tensor]:
    env = scaleout.init(timeout=60)
    rng = ModelParallelRNG(env.create_distribution(1, env.world_size))
    torch.manual_seed(0)
    before = torch.cuda.get_rng_state()
    with rng.fork("cuda"):
        inside = torch.rand(4, device="cuda")
    restored = torch.equal(torch.cuda.get_rng_state(), before)
    env.finalize()
    return restored, inside.cpu()


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_fork_on_cuda_swaps_the_device_generator() -> None:
    (restored, mine), (restored_too, other) = run_ranks(2, body_cuda, start_method="spawn",
                                                        timeout=120)
    assert restored and restored_too and not torch.equal(mine, other)
