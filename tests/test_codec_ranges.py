"""Codecs at the ends of the float range, zero-element tensors and parameters, and option types.

* ``sign`` (RMS and mean scale) keeps each block's norm for magnitudes whose norm the dtype
  holds: no overflow or underflow in ``x * x``, float64 scales for float64 gradients; the
  fused Triton kernel (under ``TRITON_INTERPRET=1`` on the CPU) computes the same scales.
* ``cast:fp16`` divides by the group size before the cast: two ranks at 40000 average to
  40000, not Inf; error feedback keeps what this rank's share actually lacked.
* A zero-element parameter is left out of DataParallel's communication (2 ranks); ``rows``
  encodes, decodes and exchanges zero-element tensors.
* Specs and constructors reject empty options and wrongly typed arguments, naming them.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from harness import run_ranks
from scaleout.compression import (BlockQuantCodec, CodecState, CompressionConfig, PowerSGDCodec,
                                  RowsCodec, SignCodec, TopKCodec, make_codec)

# -- sign: the scale over the whole range ------------------------------------------------------

F32 = [1e-40, 1e-30, 1e-23, 1e-20, 1.0, 1e19, 1e30, 1e36]
F64 = [1e-300, 1e-50, 1e-30, 1.0, 1e50, 1e300]


def _alternating(n: int, magnitude: float, dtype: torch.dtype) -> torch.Tensor:
    x = torch.full((n,), magnitude, dtype=dtype)
    x[::2] *= -1
    return x


@pytest.mark.parametrize("scale", ["rms", "mean"])
@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, m) for m in F32]
                         + [(torch.float64, m) for m in F64])
def test_sign_keeps_the_norm_at_every_magnitude(scale: str, dtype: torch.dtype, magnitude: float) -> None:
    codec = SignCodec(scale=scale, error_feedback=False)
    x = _alternating(300, magnitude, dtype)  # a whole block and a short one
    payload, ctx = codec.encode(x, CodecState())
    y = codec.decode(payload, ctx)
    assert torch.isfinite(y).all() and (y != 0).all(), f"{magnitude:g}: {y.abs().max().item():g}"
    rtol = 1e-3 if magnitude < 1e-38 and dtype == torch.float32 else 1e-6  # subnormals
    torch.testing.assert_close(y, x, rtol=rtol, atol=0)


def test_sign_rms_of_a_mixed_block_is_right_to_rounding() -> None:
    """A block holding 1e30 and 1: the RMS is the large value's share, computed without
    squaring 1e30 in float32 (which overflows) or dropping the small ones."""
    for big in (1e30, 1e-25):
        x = torch.ones(256) * big / 1e3
        x[0] = big
        payload, _ = SignCodec(error_feedback=False).encode(x, CodecState())
        want = x.double().pow(2).mean().sqrt().item()
        assert payload[1].dtype == torch.float32
        assert payload[1].item() == pytest.approx(want, rel=1e-6)


def test_sign_sends_float64_scales_for_float64_gradients() -> None:
    payload, _ = SignCodec().encode(_alternating(256, 1e50, torch.float64), CodecState())
    assert payload[1].dtype == torch.float64 and payload[1].item() == pytest.approx(1e50)
    payload, _ = SignCodec().encode(_alternating(256, 1.0, torch.float16), CodecState())
    assert payload[1].dtype == torch.float32


def test_sign_non_finite_blocks_stay_non_finite() -> None:
    x = torch.randn(512)
    x[3], x[300] = float("nan"), float("inf")
    payload, _ = SignCodec(error_feedback=False).encode(x, CodecState())
    assert not torch.isfinite(payload[1]).any()


def _sign_exchange_body(dtype: torch.dtype, magnitude: float) -> list[float]:
    import scaleout
    from scaleout import GroupType
    from scaleout.compression import compressed_allreduce

    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    codec, state, out = make_codec("sign"), CodecState(), []
    for _ in range(2):
        x = _alternating(300, magnitude, dtype) * (1 + env.rank)
        compressed_allreduce(codec, x, state, dist, group=GroupType.DATA).wait(timeout=30)
        out.append(x.abs().max().item() / magnitude)
    env.finalize()
    return out


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 1e30), (torch.float32, 1e-30),
                                              (torch.float64, 1e50), (torch.float64, 1e-50)])
def test_sign_exchange_delivers_extreme_gradients(dtype: torch.dtype, magnitude: float) -> None:
    for got in run_ranks(2, _sign_exchange_body, dtype, magnitude, timeout=60):
        assert got == pytest.approx([1.5, 1.5], rel=1e-5)  # the average of 1x and 2x


def _fused_scales_body() -> list[str]:
    import os

    from scaleout.compression.kernels import kernels_for

    assert kernels_for("sign", torch.device("cpu"), torch.float32, 256) is not None
    bad = []
    for scale in ("rms", "mean"):
        for magnitude in (1e-40, 1e-30, 1e30, 3e38):
            x = torch.linspace(-1, 1, 600) * magnitude
            x[:8] = -magnitude  # the block's largest value
            scales = {}
            for fused in ("1", "0"):
                os.environ["SCALEOUT_FUSED_CODECS"] = fused
                payload, _ = SignCodec(scale=scale).encode(x, CodecState())
                scales[fused] = payload[1]
            if not (torch.isfinite(scales["1"]).all() and (scales["1"] > 0).all()
                    and torch.allclose(scales["1"], scales["0"], rtol=1e-5, atol=0)):
                bad.append(f"{scale} {magnitude:g}: {scales['1'].tolist()} vs {scales['0'].tolist()}")
    return bad


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fused_sign_kernel_uses_the_same_scale_formula() -> None:
    (bad,) = run_ranks(1, _fused_scales_body, env={"TRITON_INTERPRET": "1"},
                       start_method="spawn", timeout=120)
    assert not bad, bad


# -- cast: divide before the cast ---------------------------------------------------------------

def _cast_body(spec: str) -> list[tuple[float, float | None]]:
    import scaleout
    from scaleout import GroupType
    from scaleout.compression import compressed_allreduce

    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    codec, state, out = make_codec(spec), CodecState(), []
    for _ in range(3):
        x = torch.full((64,), 40000.0 + env.rank)
        compressed_allreduce(codec, x, state, dist, group=GroupType.DATA).wait(timeout=30)
        residual = state.buffers.get("residual")
        out.append((x[0].item(), None if residual is None else residual[0].item()))
    env.finalize()
    return out


@pytest.mark.parametrize("spec", ["cast:fp16", "cast:fp16,error_feedback=on", "cast:bf16"])
def test_cast_averages_without_overflow(spec: str) -> None:
    results = run_ranks(2, _cast_body, spec, timeout=60)
    assert [a for a, _ in results[0]] == [a for a, _ in results[1]]
    for average, _ in results[0]:
        assert average == pytest.approx(40000.5, abs=200)  # fp16 would overflow on the sum


def test_cast_error_feedback_keeps_what_was_sent() -> None:
    """Each rank sends ``fp16((g + r) / 2)``; its residual is ``g + r - 2 * that``."""
    results = run_ranks(2, _cast_body, "cast:fp16,error_feedback=on", timeout=60)
    for rank, steps in enumerate(results):
        residual = 0.0
        for _, got in steps:
            flat = 40000.0 + rank + residual
            residual = flat - 2 * float(torch.tensor(flat / 2).half())
            assert got == pytest.approx(residual, abs=1e-3)


def test_cast_divides_before_narrowing_and_leaves_the_gradient_alone() -> None:
    x = torch.full((8,), 40000.0)
    wire = make_codec("cast:fp16")._to_wire(x, CodecState(), 2)
    assert wire.dtype == torch.float16 and (wire == 20000.0).all()
    assert (x == 40000.0).all()


# -- zero-element parameters and tensors --------------------------------------------------------

def _empty_param_body() -> list[float]:
    import scaleout
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    net.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    net[1].register_parameter("flat", nn.Parameter(torch.zeros(3, 0)))
    model = DataParallel(net, env.create_distribution(), compression="sign")
    trained = [p for p in net.parameters() if p.numel()]
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model, mode="sync")
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(2):
        (model(torch.randn(4, 8, generator=gen)).sum() + net.empty.sum()).backward()
        assert net.empty.grad is not None and net.empty.grad.numel() == 0
        opt.step()
        opt.zero_grad()
    model.synchronize()
    weights = torch.cat([p.detach().reshape(-1) for p in trained])
    env.finalize()
    return weights.tolist()


def test_zero_element_parameters_are_left_out_of_communication() -> None:
    first, second = run_ranks(2, _empty_param_body, timeout=60)
    assert first == second


def test_find_layers_skips_zero_element_parameters() -> None:
    from scaleout.pytorch.modules import find_layers

    net = nn.Linear(2, 2)
    net.register_parameter("empty", nn.Parameter(torch.empty(0)))
    (layer,) = find_layers(net)
    assert [p.numel() for p in layer.params] == [4, 2]


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0)])
def test_rows_encodes_zero_element_tensors(shape: tuple[int, ...]) -> None:
    codec = RowsCodec()
    payload, ctx = codec.encode(torch.zeros(shape), CodecState())
    assert [p.numel() for p in payload] == [0, 0]
    assert codec.decode(payload, ctx).shape == shape


def _rows_bucket_body() -> list[float]:
    import scaleout
    from scaleout import GroupType
    from scaleout.compression import compressed_allreduce

    env = scaleout.init(timeout=30)
    flat = torch.zeros(12)
    flat[2], flat[-1] = 1.0 + env.rank, 3.0
    compressed_allreduce(RowsCodec(), flat, CodecState(), env.create_distribution(),
                         group=GroupType.DATA, shapes=[(4, 2), (3, 0), (4,)]).wait(timeout=30)
    env.finalize()
    return flat.tolist()


def test_rows_bucket_with_an_empty_tensor() -> None:
    want = [0.0] * 12
    want[2], want[-1] = 1.5, 3.0
    assert run_ranks(2, _rows_bucket_body, timeout=60) == [want, want]


# -- option types --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [("topk:", "no options after ':'"),
                                           ("sign: ", "no options after ':'"),
                                           ("cast:bf16,", "empty option")])
def test_specs_with_empty_options_are_rejected(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_codec(spec)


@pytest.mark.parametrize("build, name", [
    (lambda: TopKCodec(ratio="0.5"), "ratio"),
    (lambda: TopKCodec(ratio=True), "ratio"),
    (lambda: TopKCodec(momentum="0.9"), "momentum"),
    (lambda: PowerSGDCodec(rank=True), "rank"),
    (lambda: BlockQuantCodec(block_size=True), "block_size"),
    (lambda: SignCodec(block_size=True), "block_size"),
    (lambda: RowsCodec(dense_above="0.5"), "dense_above"),
    (lambda: CompressionConfig(min_numel=True), "min_numel"),
    (lambda: CompressionConfig(warmup_steps=False), "warmup_steps"),
])
def test_constructors_reject_wrong_types(build, name: str) -> None:
    with pytest.raises(TypeError, match=name):
        build()


def test_valid_options_still_construct() -> None:
    assert TopKCodec(ratio=1).ratio == 1 and PowerSGDCodec(rank=2).rank == 2
    assert CompressionConfig(min_numel=0).min_numel == 0
    assert make_codec("topk") == TopKCodec()
