"""The fused Triton kernels of blockquant and sign give the torch paths' answers.

On the CPU, Triton's interpreter (``TRITON_INTERPRET=1``, set in a spawned rank before the
kernels load) runs the same kernel source on CPU tensors: encode/decode over three steps
(zeros, a NaN, a short last block, error feedback on and off, float16 input) and the
exchange at two ranks over gloo, each against the codec's torch path
(``SCALEOUT_FUSED_CODECS=0``). Mantissas and packed signs must be equal; decoded values and
residuals equal up to float reordering (a block's scale summed in another order). The
``gpu`` test repeats the comparison with compiled kernels on CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from harness import run_ranks

# Not imported here: the interpreter must be chosen (TRITON_INTERPRET) before Triton loads.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the fused codec kernels are written in Triton (not installed)")

SPECS = ["blockquant", "blockquant:block_size=64", "blockquant:error_feedback=off", "sign",
         "sign:scale=mean", "sign:block_size=8", "sign:error_feedback=off"]
SIZES = [1, 300, 4100]


def _gradient(step: int, n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + n)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) * 10 ** (step - 1)
    if n > 100:
        x[64:200] = 0.0  # an all-zero block
        if step == 2:
            x[7] = float("nan")  # a non-finite block
    return x.to(dtype)


def _run(spec: str, fused: bool, device: str, n: int, dtype: torch.dtype):
    from scaleout.compression import CodecState, make_codec

    os.environ["SCALEOUT_FUSED_CODECS"] = "1" if fused else "0"
    codec, state, out = make_codec(spec), CodecState(), []
    for step in range(3):
        payload, ctx = codec.encode(_gradient(step, n, 0, dtype).to(device), state)
        residual = state.buffers.get("residual")
        out.append((codec.decode(payload, ctx).float().cpu(), [p.cpu() for p in payload],
                    None if residual is None else residual.cpu().clone()))
    return out


def _compare(spec: str, fused: list, plain: list) -> None:
    for step, ((dec_f, pay_f, res_f), (dec_p, pay_p, res_p)) in enumerate(zip(fused, plain)):
        where = f"{spec} step {step}"
        for a, b in zip(pay_f, pay_p):
            if a.is_floating_point():  # sign's scales: a block's sum in another order
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-30, equal_nan=True, msg=where)
            else:  # mantissas, packed signs
                assert torch.equal(a, b), f"{where}: integer payloads differ"
        torch.testing.assert_close(dec_f, dec_p, rtol=1e-5, atol=1e-6, equal_nan=True, msg=where)
        assert (res_f is None) == (res_p is None), where
        if res_f is not None:
            torch.testing.assert_close(res_f, res_p, rtol=1e-4, atol=1e-5, msg=where)
            assert torch.isfinite(res_f).all(), f"{where}: non-finite residual"


def _encode_decode_body(device: str) -> int:
    from scaleout.compression.kernels import kernels_for

    for codec in ("blockquant", "sign"):  # the comparison must compare the kernels
        assert kernels_for(codec, torch.device(device), torch.float32, 256) is not None, codec
    checked = 0
    for spec in SPECS:
        for n in SIZES:
            for dtype in (torch.float32, torch.float16):
                _compare(f"{spec} n={n} {dtype}", _run(spec, True, device, n, dtype),
                         _run(spec, False, device, n, dtype))
                checked += 1
    return checked


def _exchange_body(device: str) -> list[float]:
    import scaleout
    from scaleout import GroupType
    from scaleout.compression import CodecState, compressed_allreduce, make_codec

    env = scaleout.init(backend="gloo", timeout=60)
    dist = env.create_distribution()
    worst = []
    for spec in SPECS:
        results = {}
        for fused in (True, False):
            os.environ["SCALEOUT_FUSED_CODECS"] = "1" if fused else "0"
            codec, state, sums = make_codec(spec), CodecState(), []
            for step in range(3):
                x = _gradient(step, 4100, env.rank, torch.float32).to(device)
                compressed_allreduce(codec, x, state, dist, group=GroupType.DATA).wait(timeout=60)
                sums.append(x.cpu())
            results[fused] = sums
        for got, want in zip(results[True], results[False]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, msg=spec)
        worst.append(max(float((a - b).abs().nan_to_num(0).max()) for a, b in zip(*results.values())))
    env.finalize()
    return worst


INTERPRET = {"TRITON_INTERPRET": "1"}


def test_fused_kernels_match_the_torch_path_on_the_cpu() -> None:
    (checked,) = run_ranks(1, _encode_decode_body, "cpu", env=INTERPRET, start_method="spawn",
                           timeout=150)
    assert checked == len(SPECS) * len(SIZES) * 2


def test_fused_exchange_matches_the_torch_path_at_two_ranks() -> None:
    results = run_ranks(2, _exchange_body, "cpu", env=INTERPRET, start_method="spawn", timeout=150)
    assert len(results) == 2 and all(len(r) == len(SPECS) for r in results)


@pytest.mark.gpu
def test_fused_kernels_match_the_torch_path_on_cuda() -> None:
    (checked,) = run_ranks(1, _encode_decode_body, "cuda", timeout=150)
    assert checked == len(SPECS) * len(SIZES) * 2
