"""A forward that mixes the split rows itself is named at the first forward, not trained wrong.

``spatial_parallel`` converts layers; a call written in a forward (``x.mean((2, 3))``,
``F.adaptive_avg_pool2d``, a smooth ``F.interpolate``, a softmax along the rows, a functional
3x3 convolution) computed on each rank's block alone, silently, before stop 23; one that rolls,
flips, crops, chunks, flattens or transposes the rows, before stop 24. ``F.pad`` of the rows
and a nearest ``F.interpolate`` to a fixed size or by a fractional factor were let through longer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel
from scaleout.pytorch.spatial import spatial_parallel, split_rows

#: what the forward does after a converted 3x3 convolution: (call, refused?)
CALLS = {
    "mean over rows": (lambda h: h.mean((2, 3)), True),
    "adaptive pool": (lambda h: F.adaptive_avg_pool2d(h, 1).flatten(1), True),
    "bilinear": (lambda h: F.interpolate(h, scale_factor=2, mode="bilinear"), True),
    "softmax rows": (lambda h: h.softmax(dim=-2), True),
    "functional 3x3": (lambda h: F.conv2d(h, torch.ones(4, 4, 3, 3), padding=1), True),
    "overlapping pool": (lambda h: F.max_pool2d(h, 3, stride=1), True),
    "group norm": (lambda h: F.group_norm(h, 2), True),
    "nearest": (lambda h: F.interpolate(h, scale_factor=2), False),
    "tiled pool": (lambda h: F.max_pool2d(h, 2), False),
    "softmax channels": (lambda h: h.softmax(dim=1), False),
    "functional 1x1": (lambda h: F.conv2d(h, torch.ones(4, 4, 1, 1)), False),
    "mean over width": (lambda h: h.mean(3), False),
    # stop 24: calls that pick, shift, crop, merge or move the rows
    "flatten rows": (lambda h: h.flatten(1), True),
    "view rows": (lambda h: h.view(h.shape[0], -1), True),
    "roll rows": (lambda h: torch.roll(h, 1, dims=2), True),
    "flip rows": (lambda h: h.flip(2), True),
    "crop rows": (lambda h: h[..., 1:-1, :], True),
    "chunk rows": (lambda h: h.chunk(2, dim=2)[0], True),
    "transpose rows": (lambda h: h.transpose(2, 3), True),
    "permute rows": (lambda h: h.permute(0, 1, 3, 2), True),
    "roll width": (lambda h: torch.roll(h, 1, dims=3), False),
    "crop width": (lambda h: h[..., 1:-1], False),
    "channels": (lambda h: h[:, :2].transpose(0, 1), False),
    "reshape keeping rows": (lambda h: h.reshape(*h.shape[:3], -1), False),
    # padding and nearest resizing: only along other dims, or by a whole factor along the rows
    "pad rows": (lambda h: F.pad(h, (0, 0, 2, 2)), True),
    "reflect all": (lambda h: F.pad(h, (1, 1, 1, 1), mode="reflect"), True),
    "nearest to a size": (lambda h: F.interpolate(h, size=(8, 12)), True),
    "nearest by 1.5": (lambda h: F.interpolate(h, scale_factor=1.5), True),
    "pad width": (lambda h: F.pad(h, (1, 2)), False),
    "reflect width": (lambda h: F.pad(h, (1, 1, 0, 0), mode="reflect"), False),
    "nearest by 2 x 1.5": (lambda h: F.interpolate(h, scale_factor=(2, 1.5)), False),
    # stop 48: calls that were let through, each a wrong result (0.23 to 10 off)
    "row norms": (lambda h: h / h.norm(dim=(2, 3), keepdim=True), True),
    "normalize rows": (lambda h: F.normalize(h, dim=2), True),
    "batch statistics": (lambda h: F.batch_norm(h, None, None, training=True), True),
    "kth along rows": (lambda h: h.kthvalue(2, dim=2).values, True),
    "einsum": (lambda h: torch.einsum("nchw,nchw->nc", h, h), True),
    "repeat rows": (lambda h: h.repeat(1, 1, 2, 1), True),
    "cat rows": (lambda h: torch.cat([h, h], dim=2), True),
    "strided 1x1": (lambda h: F.conv2d(h, torch.ones(4, 4, 1, 1), stride=2), True),
    "repeat width": (lambda h: h.repeat(1, 1, 1, 2), False),
    "cat channels": (lambda h: torch.cat([h, h], dim=1), False),
    "row norms of channels": (lambda h: h / h.norm(dim=1, keepdim=True), False),
    # a whole tensor that needs a gradient times split rows: its gradient was this rank's
    # rows' share (a layer scale, a squeeze-and-excitation gate, a linear over the width:
    # trained wrong, the ranks' copies apart)
    "learnt scale": (lambda h: h * torch.ones(1, 4, 1, 1, requires_grad=True), True),
    "linear over width": (lambda h: F.linear(h, torch.eye(6, requires_grad=True)), True),
    "constant scale": (lambda h: h * torch.full((1, 4, 1, 1), 2.0), False),
}


class Functional(nn.Module):
    def __init__(self, call: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = CALLS[self.call][0](torch.relu(self.conv(x)))
        whole = self.pool(self.conv(x)).flatten(1)  # after the global pool: rows are whole
        return h.sum() + whole.softmax(-1).mean(1).sum()  # a loss over everything: not refused


def body_calls(check: str) -> dict[str, str]:
    env = scaleout.init(timeout=20, check_consistency=check)
    dist = env.create_distribution(1, 2)
    x = torch.randn(2, 2, 8, 6, generator=torch.Generator().manual_seed(0))
    outcome = {}
    for call, (_, refused) in CALLS.items():
        net = spatial_parallel(Functional(call), dist)
        try:
            net(split_rows(x, dist))
            outcome[call] = "ok"
        except ValueError as err:
            outcome[call] = str(err)
        assert "forward" not in net.__dict__  # watched once: later forwards are the class's
    env.finalize()
    return outcome


def test_row_mixing_calls_in_a_forward_are_named_at_the_first_forward() -> None:
    for outcome in run_ranks(2, body_calls, "first", timeout=60):
        for call, (_, refused) in CALLS.items():
            if refused:
                assert outcome[call].startswith("spatial_parallel: ") and \
                    "in Functional" in outcome[call] and "split along dim 2" in outcome[call], \
                    (call, outcome[call])
            else:
                assert outcome[call] == "ok", (call, outcome[call])
        assert "mean() in Functional reduces or orders along dim 2, on a tensor split" in \
            outcome["mean over rows"]
        assert "adaptive_avg_pool2d() in Functional pools across the split rows" in \
            outcome["adaptive pool"]
        assert "pad() in Functional pads dim 2" in outcome["pad rows"]
        assert "interpolate() in Functional scales dim 2 by 1.5" in outcome["nearest by 1.5"]
        assert "mul() in Functional combines a whole tensor that needs a gradient" in \
            outcome["learnt scale"]


def body_one_dimensional() -> list[str]:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    messages = []
    for layer in (nn.Conv1d(2, 2, 3, padding=1), nn.MaxPool1d(3, 1, 1), nn.AvgPool1d(3, 1, 1),
                  nn.BatchNorm1d(2)):
        with pytest.raises(ValueError) as caught:
            spatial_parallel(nn.Sequential(layer), dist)
        messages.append(str(caught.value))
    env.finalize()
    return messages


def test_one_dimensional_layers_that_mix_the_split_length_are_refused() -> None:
    # an (N, C, L) sample is split along L: these were left as they were (0.5-0.8 off)
    for messages in run_ranks(2, body_one_dimensional, timeout=30):
        for message, name in zip(messages, ("Conv1d", "MaxPool1d", "AvgPool1d", "BatchNorm1d")):
            assert f"layer 0 ({name}) mixes rows" in message, message


def test_the_watch_is_off_under_scaleout_check_0() -> None:
    for outcome in run_ranks(2, body_calls, "off", timeout=60):
        assert set(outcome.values()) == {"ok"}, outcome


class Pooling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU())
        self.pool = Pooling()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.body(x)))


def body_through_data_parallel() -> str:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    model = DataParallel(spatial_parallel(Blocks(), dist), dist)
    try:
        model(split_rows(torch.randn(2, 2, 8, 6), dist))
        return "ok"
    except ValueError as err:
        return str(err)
    finally:
        model.close()
        env.finalize()


def test_the_watch_names_a_call_under_data_parallel() -> None:
    """DataParallel's own first-forward watch (overlap mode) runs around this one."""
    for message in run_ranks(2, body_through_data_parallel, timeout=60):
        assert "adaptive_avg_pool2d() in pool (Pooling) pools across the split rows" in message


def body_tiled_pool_equals_plain() -> float:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution(1, 2)
    plain = Functional("tiled pool").double()
    net = spatial_parallel(copy.deepcopy(plain), dist)
    x = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h = net.conv(split_rows(x, dist))  # (the forward's first half, checked against plain)
    worst = (F.max_pool2d(h, 2) - split_rows(F.max_pool2d(plain.conv(x), 2), dist)).abs().max()
    env.finalize()
    return worst.item()


def test_a_functional_pool_whose_windows_tile_is_left_alone() -> None:
    assert max(run_ranks(2, body_tiled_pool_equals_plain, timeout=60)) < 1e-12


@pytest.mark.parametrize("dim,refused", [(2, True), (-2, True), ((1, 2), True), (1, False),
                                         (None, False)])
def test_reductions_are_judged_by_their_dims(dim, refused) -> None:
    from scaleout.pytorch.spatial.watch import row_mixing
    x = torch.zeros(2, 3, 4, 5)
    args = (x,) if dim is None else (x, dim)
    assert (row_mixing("sum", x, args, {}) is not None) == refused
