"""A second bug hunt in model parallelism: each case compared with the unsplit layer.

Tensor-parallel layers built by their constructors: every rank of a model group is seeded
alike (docs/hybrid.md), and each drew its shard from that one stream, so every rank held the
same block: ``ColumnParallelLinear(4, 8)`` on 2 ranks had output rows 0-3 equal to rows
4-7, and a column layer followed by a row layer kept hidden units ``j`` and ``j + 4`` equal
through training (after 50 SGD steps still 0.0 apart: an 8-unit MLP trained as a 4-unit
one). Since stop 51 each rank keeps its part of the unsplit layer's init.

Replicated parameters inside a split region: ``tensor_parallel`` split an attention whose
forward applies a per-head ``nn.RMSNorm`` (Qwen3's QK norm) and a learnt temperature to the
split heads; the forward was exact, but each rank's gradient of those replicated parameters
was its heads' share (on 2 ranks the temperature's 4.47 and 0.87 against the unsplit 5.35).
Since stop 51 that, and a parameterised layer between a column and a row layer, is a
ValueError naming the parameters (nothing converted).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
    tensor_parallel,
)


class NormedAttention(nn.Module):
    """Attention with a per-head RMSNorm on q (Qwen3) and a learnt temperature."""

    def __init__(self, width: int = 12, n_heads: int = 6) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.q_norm = nn.RMSNorm(width // n_heads)
        self.tau = nn.Parameter(torch.tensor(0.7))
        self.norm = nn.LayerNorm(width)  # after the output projection: whole, allowed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        att = torch.softmax(self.q_norm(q) @ k.transpose(-1, -2) * self.tau, dim=-1)
        return self.norm(self.out((att @ v).transpose(1, 2).reshape(b, t, -1)))


def shared_parameters_in_split_regions_are_refused(dist: scaleout.Distribution) -> str:
    attention = NormedAttention()
    with pytest.raises(ValueError, match=r"q_norm\.weight, tau \(replicated\)"):
        tensor_parallel(attention, dist)
    assert type(attention.q) is nn.Linear  # nothing converted
    mlp = nn.Sequential(nn.Linear(4, 6), nn.PReLU(), nn.Linear(6, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"tensor_parallel: 1\.weight \(replicated\)"):
        tensor_parallel(mlp, dist, plan={"0": "column", "2": "row"})
    del attention.q_norm, attention.tau  # the same block without them converts
    attention.q_norm, attention.tau = nn.Identity(), 1.0
    tensor_parallel(attention, dist)
    return type(attention.q).__name__


def constructors_match_the_unsplit_init(dist: scaleout.Distribution) -> float:
    """The constructors' gathered weights against the plain layers' after the same seeds."""
    parts = dist.communicator(scaleout.GroupType.MODEL).size
    shapes = (8, 6 * parts, 5, 4 * parts)
    worst = 0.0
    for dtype in (torch.float64, torch.float32):
        torch.manual_seed(7)
        plain = nn.ModuleDict({"col": nn.Linear(shapes[0], shapes[1], dtype=dtype),
                               "row": nn.Linear(shapes[1], shapes[2], dtype=dtype),
                               "emb": nn.Embedding(shapes[3], 3, dtype=dtype)})
        torch.manual_seed(7)
        split = nn.ModuleDict({
            "col": ColumnParallelLinear(shapes[0], shapes[1], distribution=dist, dtype=dtype),
            "row": RowParallelLinear(shapes[1], shapes[2], distribution=dist, dtype=dtype),
            "emb": VocabParallelEmbedding(shapes[3], 3, distribution=dist, dtype=dtype)})
        gathered = full_state_dict(split)
        for key, value in plain.state_dict().items():
            worst = max(worst, (gathered[key] - value).abs().max().item())
        x = torch.randn(3, shapes[0], dtype=dtype)  # the same network, forward
        worst = max(worst, (split["row"](split["col"](x))
                            - plain["row"](plain["col"](x))).abs().max().item() / 1e3)
    return worst


def body(world_size: int) -> dict[str, float]:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution(1, world_size)
    results = {"constructors": constructors_match_the_unsplit_init(dist),
               "shared": shared_parameters_in_split_regions_are_refused(dist)}
    env.finalize()
    return results


def check(world_size: int) -> None:
    for rank, results in enumerate(run_ranks(world_size, body, world_size, timeout=60)):
        assert results["constructors"] < 1e-9, (rank, results)
        assert results["shared"] == "ColumnParallelLinear", (rank, results)


def test_model_group_of_2() -> None:
    check(2)


def test_model_group_of_3() -> None:
    check(3)
