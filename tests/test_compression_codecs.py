"""Single-process tests of every codec: stated error bounds, error feedback,
summability, edge cases, spec parsing, state checkpoints and the config."""

from __future__ import annotations

import math

import pytest
import torch

from scaleout.compression import (
    BlockQuantCodec,
    CastCodec,
    Codec,
    CodecState,
    CompressionConfig,
    Compressor,
    NoneCodec,
    PowerSGDCodec,
    SignCodec,
    TopKCodec,
    codec_spec,
    make_codec,
)
from scaleout.compression.sign import pack_bits, unpack_bits

LOSSY = ["cast:fp16", "cast:bf16", "blockquant", "sign", "topk:ratio=0.1", "topk:ratio=0.1,momentum=0.9",
         "powersgd:rank=2"]
ALL = ["none", *LOSSY]
EF = ["cast:fp16,error_feedback=true", "blockquant", "sign", "topk:ratio=0.1", "powersgd:rank=2"]


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def roundtrip(codec: Codec, x: torch.Tensor, state: CodecState | None = None) -> torch.Tensor:
    payload, ctx = codec.encode(x, CodecState() if state is None else state)
    for piece in payload:
        assert piece.dim() == 1 and piece.is_contiguous()
    return codec.decode(payload, ctx)


# -- spec strings ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("none", NoneCodec()),
        ("cast:bf16", CastCodec(dtype="bf16")),
        ("cast:dtype=fp16,error_feedback=yes", CastCodec(dtype="fp16", error_feedback=True)),
        ("blockquant", BlockQuantCodec()),
        ("blockquant:128", BlockQuantCodec(block_size=128)),
        ("sign:block_size=64", SignCodec(block_size=64)),
        ("topk:ratio=0.01", TopKCodec(ratio=0.01)),
        ("topk:0.01, momentum=0.9", TopKCodec(ratio=0.01, momentum=0.9)),
        ("powersgd:rank=4", PowerSGDCodec(rank=4)),
        (" PowerSGD:4 ", PowerSGDCodec(rank=4)),
    ],
)
def test_make_codec_parses_specs(spec: str, expected: Codec) -> None:
    codec = make_codec(spec)
    assert codec == expected
    assert make_codec(codec_spec(codec)) == codec
    assert make_codec(codec) is codec


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gzip", "valid codecs: none, cast, blockquant, sign, topk, powersgd, rows"),
        ("topk:k=3", "valid options: ratio, momentum, error_feedback"),
        ("topk:ratio=lots", "not a valid float"),
        ("topk:ratio=0", "ratio must be in (0, 1]"),
        ("topk:momentum=1", "momentum must be in [0, 1)"),
        ("topk:ratio=0.1,ratio=0.2", "twice"),
        ("cast:fp8", "unknown dtype 'fp8'"),
        ("none:3", "bare value"),
        ("sign:12", "multiple of 8"),
        ("blockquant:0", "block_size must be"),
        ("powersgd:rank=0", "rank must be"),
        # taken, then the first encode failed on "Overflow when unpacking long long"
        ("powersgd:seed=18446744073709551616", "seed must be an int in [0, 2"),
        ("cast:error_feedback=maybe", "not a valid bool"),
    ],
)
def test_make_codec_rejects_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        make_codec(spec)


def test_make_codec_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="str or a Codec"):
        make_codec(3)  # type: ignore[arg-type]


def test_codecs_are_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        TopKCodec(0.1)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        TopKCodec().ratio = 0.5  # type: ignore[misc]


# -- stated tolerances ----------------------------------------------------------


def test_none_is_exact_and_keeps_any_dtype() -> None:
    x = torch.arange(12, dtype=torch.int64).view(3, 4)
    assert torch.equal(roundtrip(NoneCodec(), x), x)


@pytest.mark.parametrize("dtype, rel, absolute", [("fp16", 2.0**-11, 2.0**-25), ("bf16", 2.0**-8, 0.0)])
def test_cast_error_bound(dtype: str, rel: float, absolute: float) -> None:
    x = rand(1000) * torch.logspace(-6, 4, 1000, dtype=torch.float32)
    y = roundtrip(CastCodec(dtype=dtype), x)
    assert y.dtype == x.dtype
    assert torch.all((y - x).abs() <= rel * x.abs() + absolute)


def test_cast_fp16_overflow_propagates_as_inf() -> None:
    y = roundtrip(CastCodec(dtype="fp16"), torch.tensor([1e5, -1.0]))
    assert y[0].item() == math.inf and y[1].item() == -1.0


@pytest.mark.parametrize("block_size", [256, 64])
def test_blockquant_error_bound(block_size: int) -> None:
    codec = BlockQuantCodec(block_size=block_size, error_feedback=False)
    x = rand(1000) * torch.logspace(-3, 3, 1000)  # blocks of very different scales
    payload, ctx = codec.encode(x, CodecState())
    assert payload[0].dtype == torch.int8 and ctx.levels == 127
    err = (codec.decode(payload, ctx) - x).abs()
    pad = (-1000) % block_size
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block_size)
    bound = torch.ldexp(torch.tensor(0.5 / 127), ctx.exponents.float())  # 2**(e-1) / L
    assert torch.all(torch.cat([err, err.new_zeros(pad)]).view(-1, block_size) <= bound[:, None] * (1 + 1e-6))
    assert torch.all(bound <= blocks.abs().amax(1) / 127 * (1 + 1e-6))  # i.e. at most amax / 127


def test_blockquant_wire_format_leaves_headroom_for_the_sum() -> None:
    codec = BlockQuantCodec()
    assert codec.wire_format(1) == (127, torch.int8)
    assert codec.wire_format(2) == (63, torch.int8)
    assert codec.wire_format(3) == (42, torch.int8)
    assert codec.wire_format(8) == (15, torch.int8)
    assert codec.wire_format(9) == (3640, torch.int16)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        codec.wire_format(0)


def test_sign_packs_bits_and_bounds_error() -> None:
    bits = rand(64) > 0
    assert torch.equal(unpack_bits(pack_bits(bits)), bits)
    x = rand(1000)
    for scale in ("rms", "mean"):
        codec = SignCodec(block_size=64, scale=scale, error_feedback=False)
        payload, ctx = codec.encode(x, CodecState())
        assert payload[0].dtype == torch.uint8 and payload[0].numel() == 1024 // 8
        assert payload[1].numel() == 16
        y = codec.decode(payload, ctx)
        assert torch.equal(y.sign(), torch.where(x < 0, -1.0, 1.0))
        for xb, yb in zip(x.split(64), y.split(64)):
            if scale == "rms":  # L2 norm kept, error at most sqrt(2) of the input
                assert yb.norm().item() == pytest.approx(xb.norm().item(), rel=1e-5)
                assert (xb - yb).norm() <= 2 ** 0.5 * xb.norm() * (1 + 1e-6)
            else:  # L1 norm kept, a contraction
                assert yb.abs().sum().item() == pytest.approx(xb.abs().sum().item(), rel=1e-5)
                assert (xb - yb).norm() <= xb.norm()
        same_magnitude = torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5])
        torch.testing.assert_close(roundtrip(codec, same_magnitude), same_magnitude)


def test_topk_sends_exact_largest_entries() -> None:
    codec = TopKCodec(ratio=0.1, error_feedback=False)
    x = rand(1000)
    payload, ctx = codec.encode(x, CodecState())
    values, indices = payload
    assert values.numel() == 100 and indices.dtype == torch.int32
    assert set(indices.tolist()) == set(x.abs().topk(100).indices.tolist())
    y = codec.decode(payload, ctx)
    assert torch.equal(y[indices.long()], x[indices.long()])
    assert (x - y).norm() ** 2 <= (1 - 100 / 1000) * x.norm() ** 2


@pytest.mark.parametrize("case", ["random", "nan", "sample-sees-only-large", "sample-sees-only-zeros"])
def test_topk_selection_on_large_tensors_equals_full_topk(case: str) -> None:
    # Large enough for the sampled-threshold path; the last two cases defeat the sample
    # (too few candidates: full top-k; every entry a candidate: exact top-k among all).
    from scaleout.compression.topk import _SAMPLE, _largest

    n, k = 8 * _SAMPLE + 13, 4000
    x = rand(n, seed=4)
    stride = n // _SAMPLE
    if case == "nan":
        x[[5, 77_777, n - 1]] = float("nan")
    elif case == "sample-sees-only-large":
        x[::stride] = torch.arange(1.0, x[::stride].numel() + 1) * 10.0  # few above the threshold
    elif case == "sample-sees-only-zeros":
        x[::stride] = 0.0
    got = _largest(x, k, CodecState())
    magnitude = x.abs().nan_to_num(nan=float("inf"))
    assert got.numel() == k and torch.equal(got, torch.sort(got).values)
    assert set(got.tolist()) == set(magnitude.topk(k).indices.tolist())


def test_topk_momentum_correction_follows_dgc() -> None:
    codec = TopKCodec(ratio=0.5, momentum=0.9)
    state = CodecState()
    g = torch.tensor([0.1, -2.0, 0.3, 1.0])
    u = torch.zeros(4)
    v = torch.zeros(4)
    for _ in range(4):
        u = 0.9 * u + g
        v = v + u
        sent = torch.zeros(4)
        top = v.abs().topk(2).indices
        sent[top] = v[top]
        v[top] = 0
        u[top] = 0
        assert torch.allclose(roundtrip(codec, g, state), sent)
        assert torch.allclose(state.buffers["residual"], v) and torch.allclose(state.buffers["momentum"], u)


def test_powersgd_exact_for_low_rank_and_a_projection_otherwise() -> None:
    codec = PowerSGDCodec(rank=2, error_feedback=False)
    low = rand(30, 2, seed=1) @ rand(2, 20, seed=2)
    assert torch.allclose(roundtrip(codec, low), low, atol=1e-5)
    x = rand(30, 20)
    assert (roundtrip(codec, x) - x).norm() <= x.norm()
    conv = rand(8, 3, 3, 3)  # conv weight -> 8 x 27, rank 2 compresses it
    assert codec.matrix_shape(conv.shape) == (8, 27)
    assert roundtrip(codec, conv).shape == conv.shape


def test_powersgd_warm_start_converges_to_best_rank_r() -> None:
    u, _ = torch.linalg.qr(rand(40, 40, seed=3))
    v, _ = torch.linalg.qr(rand(30, 30, seed=4))
    spectrum = torch.tensor([2.0**-i for i in range(30)])
    x = u[:, :30] @ torch.diag(spectrum) @ v.T
    codec = PowerSGDCodec(rank=3, error_feedback=False)
    state = CodecState()
    for _ in range(15):
        y = roundtrip(codec, x, state)
    best = spectrum[3:].norm()
    assert (y - x).norm() <= best * 1.001


@pytest.mark.parametrize("shape", [(100,), (), (3, 2)])
def test_powersgd_falls_back_uncompressed(shape: tuple[int, ...]) -> None:
    codec = PowerSGDCodec(rank=4)
    x = rand(*shape)
    payload, _ = codec.encode(x, CodecState())
    assert len(payload) == 1
    assert torch.equal(roundtrip(codec, x), x)


# -- error feedback -------------------------------------------------------------


@pytest.mark.parametrize("spec", EF)
def test_error_feedback_keeps_exactly_the_residual(spec: str) -> None:
    """residual == (g + previous residual) - decode, and nothing is ever lost."""
    codec = make_codec(spec)
    state = CodecState()
    total_in = torch.zeros(24, 16, dtype=torch.float64)
    total_out = torch.zeros(24, 16, dtype=torch.float64)
    for step in range(6):
        g = rand(24, 16, seed=step)
        before = state.buffers.get("residual", torch.zeros(24 * 16)).clone()
        y = roundtrip(codec, g, state)
        residual = state.buffers["residual"]
        assert torch.allclose(residual, (g.reshape(-1) + before) - y.reshape(-1), atol=1e-6)
        total_in += g.double()
        total_out += y.double()
    assert torch.allclose(total_out + residual.view(24, 16).double(), total_in, atol=1e-4)


@pytest.mark.parametrize("spec", ["blockquant:error_feedback=0", "sign:error_feedback=off",
                                  "topk:error_feedback=false", "powersgd:error_feedback=no"])
def test_error_feedback_off_stores_no_residual(spec: str) -> None:
    state = CodecState()
    codec = make_codec(spec)
    a = roundtrip(codec, rand(24, 16), state)
    b = roundtrip(codec, rand(24, 16), state)
    assert "residual" not in state.buffers and a.shape == b.shape


# -- summability ----------------------------------------------------------------


def test_summable_codecs_decode_the_sum_of_payloads() -> None:
    xs = [rand(300, seed=s) for s in range(3)]
    codec = NoneCodec()
    pays = [codec.encode(x.clone(), CodecState()) for x in xs]
    summed = sum(p[0][0] for p in pays)
    assert torch.allclose(codec.decode([summed], pays[0][1]), sum(xs))
    cast = CastCodec(dtype="fp16")
    pays = [cast.encode(x, CodecState()) for x in xs]
    summed = sum(p[0][0] for p in pays)  # the wire sums in fp16: one more rounding
    want = sum(cast.decode(*p) for p in pays)
    assert torch.allclose(cast.decode([summed], pays[0][1]), want, rtol=2.0**-10, atol=1e-3)


@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_blockquant_aligned_payloads_sum_exactly(ranks: int) -> None:
    codec = BlockQuantCodec()
    xs = [rand(700, seed=s) * (s + 1) for s in range(ranks)]
    shared = torch.stack([codec.exponents(x) for x in xs]).amax(0)
    pays = [codec.quantize(x, CodecState(), shared, ranks) for x in xs]
    ints = torch.stack([p[0][0].to(torch.int32) for p in pays]).sum(0)
    assert ints.abs().max() <= 127  # the int8 wire sum cannot overflow
    summed = sum(p[0][0] for p in pays)  # int8 + int8 stays int8 in torch: no overflow above
    decoded_sum = codec.decode([summed], pays[0][1])
    sum_of_decodes = sum(codec.decode(*p) for p in pays)
    assert torch.allclose(decoded_sum, sum_of_decodes, rtol=1e-6, atol=1e-6)
    levels = 127 // ranks
    bound = ranks * torch.stack(xs).abs().amax() / levels
    assert (decoded_sum - sum(xs)).abs().max() <= bound


@pytest.mark.parametrize("spec", ["sign", "topk:ratio=0.2", "powersgd:rank=2"])
def test_gathered_codecs_decode_sum_matches_decodes(spec: str) -> None:
    codec = make_codec(spec)
    xs = [rand(20, 30, seed=s) for s in range(3)]
    pays = [codec.encode(x, CodecState()) for x in xs]
    want = sum(codec.decode(*p) for p in pays)
    got = codec.decode_sum([p[0] for p in pays], pays[0][1])
    assert torch.allclose(got.view(20, 30), want, atol=1e-5)


# -- edge cases -----------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (257,), (3, 5, 7), (0,)])
def test_shapes_and_dtypes_round_trip(spec: str, shape: tuple[int, ...]) -> None:
    codec = make_codec(spec)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = rand(*shape, dtype=dtype) if shape != (0,) else torch.zeros(0, dtype=dtype)
        y = roundtrip(codec, x)
        assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("spec", ALL)
def test_all_zeros_stay_zero(spec: str) -> None:
    state = CodecState()
    x = torch.zeros(40, 30)
    assert torch.equal(roundtrip(make_codec(spec), x, state), x)
    assert torch.count_nonzero(state.buffers.get("residual", torch.zeros(1))) == 0


@pytest.mark.parametrize("spec", ALL)
def test_non_contiguous_input_is_read_correctly(spec: str) -> None:
    base = rand(30, 40)
    view = base.t()
    assert not view.is_contiguous()
    codec = make_codec(spec)
    a = roundtrip(codec, view)
    b = roundtrip(codec, view.contiguous())
    assert torch.equal(a, b) and torch.equal(base.t(), view)


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_propagates_without_poisoning_state(spec: str, bad: float) -> None:
    codec = make_codec(spec)
    state = CodecState()
    roundtrip(codec, rand(24, 16, seed=1), state)
    x = rand(24, 16, seed=2)
    x[3, 5] = bad
    y = roundtrip(codec, x, state)
    assert not torch.isfinite(y).all(), "non-finite input must give a non-finite result"
    for name, buffer in state.buffers.items():
        assert torch.isfinite(buffer).all(), f"{name} was poisoned"
    assert torch.isfinite(roundtrip(codec, rand(24, 16, seed=3), state)).all()


@pytest.mark.parametrize("spec", LOSSY)
def test_integer_input_is_a_type_error(spec: str) -> None:
    with pytest.raises(TypeError, match="floating-point"):
        make_codec(spec).encode(torch.ones(4, 4, dtype=torch.int32), CodecState())


def test_residual_of_the_wrong_size_is_reported() -> None:
    state = CodecState()
    roundtrip(make_codec("sign"), rand(10), state)
    with pytest.raises(ValueError, match="one CodecState per tensor"):
        roundtrip(make_codec("sign"), rand(11), state)


# -- state and config -----------------------------------------------------------


@pytest.mark.parametrize("spec", EF + ["topk:ratio=0.1,momentum=0.9"])
def test_state_dict_resumes_identically(spec: str) -> None:
    codec = make_codec(spec)
    a, b = CodecState(), CodecState()
    for step in range(3):
        roundtrip(codec, rand(24, 16, seed=step), a)
    b.load_state_dict(a.state_dict())
    assert b.step == a.step and set(b.buffers) == set(a.buffers)
    x = rand(24, 16, seed=9)
    assert torch.equal(roundtrip(codec, x, a), roundtrip(codec, x, b))


def test_state_dict_validation() -> None:
    with pytest.raises(ValueError, match="missing"):
        CodecState().load_state_dict({"step": 1})
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        CodecState().load_state_dict({"step": 1, "buffers": {"residual": [1.0]}})
    with pytest.raises(ValueError, match="'states'"):
        Compressor().load_state_dict({})


def test_config_selects_by_size_warmup_and_glob() -> None:
    cfg = CompressionConfig(codec="topk:ratio=0.01", layers={"*.bias": "none", "fc*": "powersgd:rank=1"},
                            min_numel=100, warmup_steps=2)
    big = torch.zeros(50, 50)
    assert cfg.select("conv.weight", big, step=2) == TopKCodec(ratio=0.01)
    assert cfg.select("conv.weight", big, step=1).name == "none"  # warm-up
    assert cfg.select("conv.weight", torch.zeros(99), step=5).name == "none"  # too small
    assert cfg.select("conv.bias", torch.zeros(500), step=5).name == "none"
    assert cfg.select("fc1.weight", big, step=5) == PowerSGDCodec(rank=1)
    assert cfg.select("conv.weight", big.long(), step=5).name == "none"  # integers


@pytest.mark.parametrize(
    "kwargs, error",
    [({"min_numel": -1}, ValueError), ({"warmup_steps": -2}, ValueError), ({"codec": "nope"}, ValueError),
     ({"layers": {"*": "topk:ratio=2"}}, ValueError), ({"layers": [("*", "none")]}, TypeError),
     ({"layers": {3: "none"}}, TypeError)],
)
def test_config_validates_on_construction(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        CompressionConfig(**kwargs)


def test_compressor_state_dict_round_trip() -> None:
    comp = Compressor("sign")
    state = comp.state("w")
    roundtrip(comp.codec_for("w", torch.zeros(2000)), rand(2000), state)
    state.step = 4
    other = Compressor("sign")
    other.load_state_dict(comp.state_dict())
    assert other.state("w").step == 4
    assert torch.equal(other.state("w").buffers["residual"], state.buffers["residual"])
