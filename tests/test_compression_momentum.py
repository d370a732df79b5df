"""Compressing the momentum (CompressionConfig(momentum=...)) and the codecs' stated limits.

MomentumCodec (one launch per world size): the increments it returns rebuild, in a plain
SGD(momentum=beta), the exchanged momentum exactly; with the exact codec that is SGD on the
averaged gradient; every rank agrees bit for bit; the state checkpoints (resumed mid-way);
NaN reaches every rank without poisoning the state. advice: which optimizer settings each codec warns about, per parameter group.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import scaleout
from harness import run_ranks
from scaleout import GroupType
from scaleout.compression import (
    CodecState,
    CompressionConfig,
    MomentumCodec,
    NoneCodec,
    compressed_allreduce,
    make_codec,
)
from scaleout.compression.advice import codec_label, optimizer_traits, unsuited, warn_unsuited

BETA = 0.9


def grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(48, 40, generator=torch.Generator().manual_seed(1000 * step + rank)) * (rank + 1)


def _body(steps: int) -> dict[str, object]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    out = {spec: _follow(spec, steps, env, d) for spec in ("none", "sign")}
    out["nan"] = _nan(env, d)
    env.finalize()
    return out


def _follow(spec: str, steps: int, env: scaleout.Environment, d: scaleout.Distribution) -> dict:
    """SGD(momentum=BETA) fed with the MomentumCodec's increments vs fed with exact averages."""
    codec = MomentumCodec(codec=make_codec(spec), momentum=BETA)
    ours, exact = torch.zeros(48, 40, requires_grad=True), torch.zeros(48, 40, requires_grad=True)
    opt_ours = torch.optim.SGD([ours], lr=0.1, momentum=BETA)
    opt_exact = torch.optim.SGD([exact], lr=0.1, momentum=BETA)
    state, buffers_match = CodecState(), True
    for step in range(steps):
        if step == steps // 2:  # resume from a checkpoint of the codec state mid-way
            restored = CodecState()
            restored.load_state_dict(state.state_dict())
            state = restored
        g = grad(env.rank, step)
        out = compressed_allreduce(codec, g.clone(), state, d, group=GroupType.DATA).wait(timeout=30)
        ours.grad, exact.grad = out, sum(grad(r, step) for r in range(env.world_size)) / env.world_size
        opt_ours.step()
        opt_exact.step()
        delivered = state.buffers["delivered"].view(48, 40) / env.world_size  # M_t, exchanged
        buffers_match &= torch.allclose(opt_ours.state[ours]["momentum_buffer"], delivered,
                                        rtol=1e-5, atol=1e-5)
    return {"ours": ours.detach(), "exact": exact.detach(), "buffers_match": buffers_match,
            "keys": sorted(state.buffers)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_increments_rebuild_the_momentum_in_plain_sgd(world_size: int) -> None:
    results = run_ranks(world_size, _body, 6, timeout=60)
    for rank, out in enumerate(results):  # NaN on rank 1
        finite, clean = out["nan"]
        assert not finite, f"rank {rank}: NaN on rank 1 did not propagate"
        assert clean, f"rank {rank}: momentum state poisoned by NaN"
    for spec in ("none", "sign"):
        first = results[0][spec]
        for other in results[1:]:
            assert torch.equal(other[spec]["ours"], first["ours"]), f"{spec}: ranks disagree"
        assert first["buffers_match"], f"{spec}: SGD's momentum buffer is not the exchanged momentum"
        assert {"local_momentum", "delivered"} <= set(first["keys"])
        if spec == "none":  # exact codec: SGD on the averaged gradient, up to float rounding
            torch.testing.assert_close(first["ours"], first["exact"], rtol=1e-5, atol=1e-5)
        else:
            assert not torch.equal(first["ours"], first["exact"])  # sign is lossy


def _nan(env: scaleout.Environment, d: scaleout.Distribution) -> tuple[bool, bool]:
    codec, state = MomentumCodec(codec=make_codec("sign"), momentum=BETA), CodecState()
    compressed_allreduce(codec, grad(env.rank, 0), state, d, group=GroupType.DATA).wait(timeout=30)
    x = grad(env.rank, 1)
    if env.rank == 1:
        x[3, 5] = float("nan")
    y = compressed_allreduce(codec, x, state, d, group=GroupType.DATA).wait(timeout=30)
    return bool(torch.isfinite(y).all()), all(bool(torch.isfinite(b).all()) for b in state.buffers.values())


def test_config_wraps_every_lossy_codec_and_validates() -> None:
    cfg = CompressionConfig(codec="sign", layers={"a*": "none", "b*": "topk:ratio=0.1"}, momentum=BETA)
    assert isinstance(cfg.codec, MomentumCodec) and cfg.codec.codec.name == "sign"
    assert isinstance(cfg.layers["a*"], NoneCodec)
    assert codec_label(cfg.layers["b*"]) == "topk+momentum"
    assert not isinstance(CompressionConfig(codec="sign").codec, MomentumCodec)
    for bad in (1.0, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="momentum must be a number in"):
            CompressionConfig(codec="sign", momentum=bad)
    with pytest.raises(TypeError, match="non-momentum"):
        MomentumCodec(codec=cfg.codec, momentum=BETA)
    with pytest.raises(ValueError, match=r"momentum must be in \(0, 1\)"):
        MomentumCodec(codec=make_codec("sign"), momentum=0.0)
    with pytest.raises(TypeError, match="momentum must be a number, got str '0.5'"):
        MomentumCodec(codec=make_codec("sign"), momentum="0.5")  # (it failed at an exchange)
    with pytest.raises(ValueError, match="scale must be one of"):
        make_codec("sign:scale=max")


def _sgd(*lrs: float, momentum: float = BETA) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=momentum)


def test_codecs_state_their_limits_per_parameter_group() -> None:
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    for spec in ("cast:fp16", "cast:bf16", "blockquant", "rows", "none"):
        for opt in (_sgd(0.1, 0.02), adamw):
            assert unsuited(CompressionConfig(codec=spec), opt) == [], spec
    assert unsuited(CompressionConfig(codec="sign"), _sgd(0.1, momentum=0.0)) == []
    (msg,) = unsuited(CompressionConfig(codec="sign"), _sgd(0.02))
    assert "CompressionConfig(momentum=0.9)" in msg and msg.startswith("codec 'sign' with SGD")
    (msg,) = unsuited(CompressionConfig(codec="sign", momentum=BETA), _sgd(0.1, 0.02))
    assert "1-bit signs of the momentum" in msg
    (msg,) = unsuited(CompressionConfig(codec="sign", momentum=0.5), _sgd(0.1))
    assert "momentum to be the same" in msg
    nesterov = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=BETA, nesterov=True)
    (msg,) = unsuited(CompressionConfig(codec="sign", momentum=BETA), nesterov)
    assert "nesterov=False" in msg
    assert unsuited(CompressionConfig(codec="topk:ratio=0.05"), _sgd(0.01)) == []
    assert len(unsuited(CompressionConfig(codec="topk:ratio=0.05"), _sgd(0.02))) == 1
    assert unsuited(CompressionConfig(codec="powersgd"), _sgd(0.05)) == []
    assert len(unsuited(CompressionConfig(codec="powersgd"), _sgd(0.1))) == 1
    for spec in ("sign", "topk", "powersgd"):
        for momentum in (0.0, BETA):
            (msg,) = unsuited(CompressionConfig(codec=spec, momentum=momentum), adamw)
            assert "with AdamW" in msg
    traits = optimizer_traits(_sgd(0.1, 0.02))
    assert [t.step for t in traits] == pytest.approx([1.0, 0.2]) and not traits[0].adaptive
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        optimizer_traits("sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(warn_unsuited(CompressionConfig(codec="sign"), adamw)) == 1
    assert [w.category for w in caught] == [UserWarning]
