"""DataParallel(compression=...): codecs through the front end, per-layer selection, bytes counted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer


def body(spec: object, weights: bool = False) -> list[float]:
    env = scaleout.init(timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DataParallel(net, env.create_distribution(), compression=spec)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), model)
    g = torch.Generator().manual_seed(env.rank)
    for _ in range(4):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    total = model.statistics.total()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = model.distribution.allgather(flat, group=scaleout.GroupType.DATA).wait()
    for other in gathered.view(env.world_size, -1):  # replicas stay identical
        torch.testing.assert_close(other, flat, rtol=0, atol=0)
    model.close()
    env.finalize()
    return flat.tolist() if weights else [total.raw_bytes / max(total.bytes, 1)]


@pytest.mark.parametrize("spec,min_ratio", [
    ("cast:bf16", 1.9), ("blockquant", 3.0), ("sign", 8.0), ("topk:ratio=0.05", 4.0),
    ("powersgd:rank=2", 4.0), ({"0.*": "topk:ratio=0.05"}, 1.5),
])
def test_codecs_through_data_parallel(spec: object, min_ratio: float) -> None:
    ratios = run_ranks(2, body, spec, timeout=120)
    assert ratios[0][0] >= min_ratio, ratios


@pytest.mark.parametrize("spec", ["topk:ratio=1", {"0.*": "topk:ratio=1"}])
def test_a_codec_that_keeps_everything_trains_like_exact(spec: object) -> None:
    """The codec path's values, not only its replicas' agreement: top-k keeping every value
    must train to the exact run's weights (a codec path that summed instead of averaging, or
    scaled twice, kept the replicas identical and passed the test above)."""
    exact = run_ranks(2, body, None, True, timeout=120)[0]
    coded = run_ranks(2, body, spec, True, timeout=120)[0]
    assert coded == pytest.approx(exact, rel=1e-5, abs=1e-6)


def body_checkpoint() -> None:
    env = scaleout.init(timeout=60)
    torch.manual_seed(0)

    def build() -> tuple[nn.Module, DataParallel, DistributedOptimizer]:
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        model = DataParallel(net, env.create_distribution(), compression="topk:ratio=0.05")
        return net, model, DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), model)

    net, model, opt = build()
    g = torch.Generator().manual_seed(env.rank)
    for _ in range(2):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    saved = model.state_dict()
    residuals = saved["_extra_state"]["compression"]
    # One compressed bucket holds both weights (biases are below min_numel and go exact).
    assert set(residuals) == {"2.weight+0.weight"}
    first = residuals["2.weight+0.weight"]["states"]["2.weight+0.weight"]
    assert any(torch.is_tensor(v) and v.abs().sum() > 0 for v in first["buffers"].values())
    _, restored, _ = build()
    restored.load_state_dict(saved)
    restored(torch.randn(2, 64))  # the first forward builds the session and applies the state
    again = restored.state_dict()["_extra_state"]["compression"]
    for key, value in first["buffers"].items():
        bucket = again["2.weight+0.weight"]["states"]["2.weight+0.weight"]
        torch.testing.assert_close(bucket["buffers"][key], value)
    model.close()
    restored.close()
    env.finalize()


def test_error_feedback_state_is_checkpointed() -> None:
    run_ranks(2, body_checkpoint, timeout=120)
