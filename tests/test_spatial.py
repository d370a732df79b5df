"""Spatial parallelism: a 2-D and a 3-D CNN on height- (depth-) split samples equal the
unsplit CNNs, and train to the same weights on a data x model grid (float64, tight tolerance)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import GroupType
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.pytorch.spatial import (
    SpatialBatchNorm,
    SpatialConv,
    SpatialGlobalAvgPool,
    spatial_parallel,
    split_rows,
)

PER_RANK, STEPS, HEIGHT = 2, 3, 12


class Net(nn.Module):
    """2-D: conv 3x3, max-pool 2 (local on each block), conv 5x5; 3-D: two 3x3x3 convs."""

    def __init__(self, kind: str, distribution=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm: nn.Module = nn.BatchNorm2d(4) if kind == "2d-bn" else nn.Identity()
        if kind.startswith("2d"):
            self.conv1: nn.Module = nn.Conv2d(2, 4, 3, padding=1)
            self.conv2: nn.Module = nn.Conv2d(4, 4, 5, padding=2)
            self.down: nn.Module = nn.MaxPool2d(2)
            self.pool: nn.Module = nn.AdaptiveAvgPool2d(1)
        else:
            self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
            self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
            self.down = nn.Identity()
            self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(4, 3)
        if distribution is not None and kind == "3d":  # the converter does the same
            spatial_parallel(self, distribution)
        elif distribution is not None:
            self.conv1 = SpatialConv(self.conv1, distribution=distribution, name="conv1")
            self.conv2 = SpatialConv(self.conv2, distribution=distribution, name="conv2")
            if kind == "2d-bn":
                self.norm = SpatialBatchNorm(self.norm, distribution=distribution, name="norm")
            self.pool = SpatialGlobalAvgPool(distribution=distribution)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(self.down(F.relu(self.norm(self.conv1(x))))))
        return self.fc(self.pool(h).flatten(1))


def batch(kind: str, step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    shape = (samples, 2, HEIGHT, 6) if kind.startswith("2d") else (samples, 2, HEIGHT, 3, 3)
    return (torch.randn(*shape, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (samples,), generator=g))


def reference(kind: str, data_parts: int) -> dict[str, torch.Tensor]:
    net = Net(kind).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * data_parts)
        for d in range(data_parts):
            rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
            (F.cross_entropy(net(x[rows]), y[rows]) / data_parts).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.named_parameters()}


def body_cases(cases: list[tuple[str, int, int]]) -> None:
    """``spatial`` of each case in turn, in one job (its start-up costs more than a case)."""
    env = scaleout.init(timeout=60)
    for case in cases:
        spatial(env, *case)
    env.finalize()


def spatial(env: scaleout.Environment, kind: str, data_parts: int, model_parts: int) -> None:
    dist = env.create_distribution(data_parts, model_parts)
    net = Net(kind, dist).double()
    x, _ = batch(kind, 0, 2)
    with torch.no_grad():  # the forward alone equals the unsplit network's
        torch.testing.assert_close(net(split_rows(x, dist)), Net(kind).double()(x), rtol=1e-12,
                                   atol=1e-12)
        # activation memory falls by the model degree: each rank holds 1/p of conv1's output
        assert net.conv1(split_rows(x, dist)).numel() * model_parts == \
            Net(kind).double().conv1(x).numel()
    model = DataParallel(net, dist)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9), model)
    d = dist.rank(GroupType.DATA)
    for step in range(STEPS):
        x, y = batch(kind, step, PER_RANK * data_parts)
        rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
        F.cross_entropy(model(split_rows(x[rows], dist)), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    if model_parts > 1:  # halos, reported (a model group of one has none to exchange)
        assert model.statistics.operation("conv2 (activations)").bytes > 0
    for name, value in reference(kind, data_parts).items():
        torch.testing.assert_close(dict(net.named_parameters())[name].detach(), value,
                                   rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {kind} {n}: {m}")
    model.close()


#: (kind, data_parts, model_parts)
CASES = [("2d", 1, 2), ("2d", 2, 2), ("2d", 1, 3), ("3d", 1, 2), ("3d", 2, 2), ("2d-bn", 1, 2),
         ("2d-bn", 2, 2), ("2d-bn", 1, 3), ("2d-bn", 2, 1)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_spatial_cnn_matches_single_process(world: int) -> None:  # the cases of CASES on world
    run_ranks(world, body_cases, [case for case in CASES if case[1] * case[2] == world],
              timeout=120)


def test_unsupported_convolution_is_named() -> None:
    class Fake:
        def communicator(self, group):  # never reached: the check comes first
            raise AssertionError

    with pytest.raises(ValueError, match=r"SpatialConv c: needs stride 1.*stride \(2, 2\)"):
        SpatialConv(nn.Conv2d(1, 1, 3, stride=2, padding=1), distribution=Fake(), name="c")


def test_converter_names_a_convolution_it_cannot_split() -> None:
    class Grid1:
        def communicator(self, group):
            class Comm:
                size, rank = 1, 0
            return Comm()

    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Conv2d(2, 2, 4, padding=2))
    with pytest.raises(ValueError, match=r"SpatialConv 1: needs .*kernel \(4, 4\)"):
        spatial_parallel(net, Grid1())
    assert type(net[0]) is nn.Conv2d  # nothing converted


def body_empty_batch() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    x, _ = batch("2d-bn", 0, 2)
    net, plain = Net("2d-bn", dist).double(), Net("2d-bn").double()
    for inputs in (x, x[:0], x):  # a step on no samples (the last, short batch, say)
        out = net(split_rows(inputs, dist))
        torch.testing.assert_close(out, plain(inputs), rtol=1e-12, atol=1e-12)
    for name in ("running_mean", "running_var"):  # the empty step left them as BatchNorm does
        torch.testing.assert_close(getattr(net.norm, name), getattr(plain.norm, name),
                                   rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    env.finalize()


def test_an_empty_batch_passes_like_the_unsplit_layers() -> None:
    # the global pool indexed the first sample (IndexError); batch norm's statistics of no
    # values (0 / 0) turned its running mean and variance into NaN for good
    run_ranks(2, body_empty_batch, timeout=40)


def body_with_tensor_parallel_head() -> None:
    from scaleout.pytorch import tensor_parallel

    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    net = spatial_parallel(tensor_parallel(copy.deepcopy(plain), dist), dist)
    x, _ = batch("2d", 0, 2)
    with torch.no_grad():  # the head's shards are each rank's own: not broadcast from rank 0
        torch.testing.assert_close(net(split_rows(x, dist)), plain(x), rtol=1e-12, atol=1e-12)
    env.finalize()


def test_a_tensor_parallel_head_keeps_its_shards() -> None:
    # spatial_parallel broadcast every parameter from model rank 0, shards included
    run_ranks(2, body_with_tensor_parallel_head, timeout=40)


def body_adaptive_pools() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    for pool in (nn.AdaptiveMaxPool2d(1), nn.AdaptiveAvgPool2d(2)):  # a global max, 2 x 2 cells
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), pool, nn.Flatten())
        with pytest.raises(ValueError, match=rf"spatial_parallel: layer 1 \({type(pool).__name__}"
                                             r"\) pools across the split rows"):
            spatial_parallel(net, dist)
        assert type(net[0]) is nn.Conv2d  # nothing converted
    keeps = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.AdaptiveMaxPool2d((None, 1)))
    spatial_parallel(keeps, dist)  # pools each row alone: it works on each block unchanged
    assert type(keeps[1]) is nn.AdaptiveMaxPool2d
    env.finalize()


def test_adaptive_pooling_it_cannot_split_is_named() -> None:
    # left as it was, each rank pooled its own rows: a wrong result, silently
    run_ranks(2, body_adaptive_pools, timeout=30)


def body_fixed_pools() -> list[float]:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    errors = []
    for pool in (nn.MaxPool2d(2), nn.AvgPool2d(3), nn.MaxPool3d((2, 1, 1))):
        three = isinstance(pool, nn.MaxPool3d)
        conv = nn.Conv3d(1, 2, 3, padding=1) if three else nn.Conv2d(1, 2, 3, padding=1)
        torch.manual_seed(0)
        net = nn.Sequential(conv, nn.ReLU(), pool)
        plain = copy.deepcopy(net)
        spatial_parallel(net, dist)
        x = torch.randn(2, 1, 12, 6, *([4] if three else []))  # 6 rows per rank: tiled
        errors.append((net(split_rows(x, dist)) - split_rows(plain(x), dist)).abs().max().item())
        # 5 rows per rank: a window would straddle the blocks
        with pytest.raises(ValueError, match=r"layer 2 pools windows of \d rows, and this "
                                             r"rank's block has 5 rows"):
            net(split_rows(torch.randn(2, 1, 10, 6, *([4] if three else [])), dist))
    for pool in (nn.MaxPool2d(2, stride=1), nn.AvgPool2d(2, padding=1),
                 nn.MaxPool2d(2, ceil_mode=True)):
        net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), pool)
        with pytest.raises(ValueError, match=rf"layer 1 \({type(pool).__name__}\) pools the "
                                             r"split rows with kernel 2"):
            spatial_parallel(net, dist)
        assert type(net[0]) is nn.Conv2d  # nothing converted
    env.finalize()
    return errors


def test_fixed_pools_split_when_their_windows_tile_the_blocks() -> None:
    # left as they were, a window straddling two ranks' blocks pooled each part alone
    for errors in run_ranks(2, body_fixed_pools, timeout=30):
        assert max(errors) < 1e-6, errors


def body_rows_mixers() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    for layer in (nn.GroupNorm(2, 4), nn.InstanceNorm2d(4, affine=True), nn.LayerNorm([6, 6]),
                  nn.ConvTranspose2d(4, 4, 3, padding=1), nn.Upsample(scale_factor=2,
                                                                      mode="bilinear"),
                  nn.ZeroPad2d(1), nn.ReflectionPad2d((0, 0, 1, 1)), nn.ConstantPad1d(1, 0.5),
                  nn.Upsample(size=(12, 12)), nn.Upsample(scale_factor=1.5)):
        net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), layer)
        with pytest.raises(ValueError, match=rf"spatial_parallel: layer 1 \({type(layer).__name__}"
                                             r"\) mixes rows"):
            spatial_parallel(net, dist)
        assert type(net[0]) is nn.Conv2d  # nothing converted
    nearest = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Upsample(scale_factor=2),
                            nn.LayerNorm(6, elementwise_affine=False))
    spatial_parallel(nearest, dist)  # each row on its own: works on each block unchanged
    with pytest.warns(UserWarning, match=r"leaves 1 \(PReLU\) as it is"):
        spatial_parallel(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.PReLU(4)), dist)
    env.finalize()


def test_layers_that_mix_rows_are_refused_and_unknown_ones_named() -> None:
    # left as they were, each computed on its rank's block alone: wrong, silently
    run_ranks(2, body_rows_mixers, timeout=30)


def body_row_wise_padding_and_resizing() -> float:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReflectionPad2d((2, 1, 0, 0)),
                          nn.ZeroPad2d((1, 0, 0, 0)), nn.Upsample(scale_factor=(2, 1.5)),
                          nn.Conv2d(2, 2, 3, padding=1)).double()
    net = spatial_parallel(copy.deepcopy(plain), dist)
    assert [type(m) for m in net[1:4]] == [type(m) for m in plain[1:4]]  # left as they were
    x = torch.randn(2, 1, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    worst = (net(split_rows(x, dist)) - split_rows(plain(x), dist)).abs().max().item()
    env.finalize()
    return worst


def test_padding_other_dims_and_nearest_by_whole_factors_work_on_each_block() -> None:
    """Padding the rows, resizing to a fixed size or by 1.5 were left as they were (1e-3..3e-2
    off, silently): refused above; what stays works on each block alone."""
    assert max(run_ranks(2, body_row_wise_padding_and_resizing, timeout=30)) < 1e-12


def body_uneven_blocks() -> float:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten()).double()
    split = spatial_parallel(copy.deepcopy(plain), dist)
    x = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    block = torch.tensor_split(x, 2, dim=2)[env.rank]  # 3 rows and 2
    worst = (split(block) - plain(x)).abs().max().item()
    worst = max(worst, (split[1].running_var - plain[1].running_var).abs().max().item())
    env.finalize()
    return worst


def test_blocks_of_different_heights_count_their_own_rows() -> None:
    """Batch norm and the global pool counted every rank's rows as its own (0.1 off)."""
    assert max(run_ranks(2, body_uneven_blocks, timeout=30)) < 1e-12
