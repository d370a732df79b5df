"""Codecs are device code: every buffer on the input's device, results equal to the CPU's.

Two CPU tests catch a buffer allocated without ``device=`` on any machine:

* on the ``meta`` device (no data: codecs whose algorithm needs no size on the host), every
  state tensor must be a meta tensor; a CPU constant or scratch would fail or show up;
* on CPU input with the *default* device set to ``meta``, a ``torch.zeros(n)`` without
  ``device=`` makes a meta tensor, which then fails the arithmetic or shows up in the state.

The ``gpu`` tests (skipped without CUDA, failures under ``SCALEOUT_REQUIRE_GPU=1``) run every
codec on CUDA tensors: encode/decode and the exchange at world size 1 (NCCL) and at 2 ranks
sharing the GPU over gloo, each against the same computation on the CPU. Their CUDA work
runs in forked ranks only, so this process never initialises CUDA (a forked child could not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import scaleout
from harness import run_ranks
from scaleout import GroupType
from scaleout.core.collectives import Communicator
from scaleout.compression import Codec, CodecState, MomentumCodec, compressed_allreduce, make_codec

SPECS = ["none", "cast:fp16", "cast:bf16,error_feedback=on", "blockquant", "sign", "sign:block_size=64",
         "topk:ratio=0.05", "topk:ratio=0.05,momentum=0.9", "powersgd:rank=2", "rows"]
#: Codecs whose encode/decode/exchange need no value on the host (meta tensors have none;
#: on CUDA they run under ``torch.cuda.set_sync_debug_mode("error")``). top-k and rows need
#: a count on the host (docs/compression.md lists why).
META_SPECS = [s for s in SPECS if not s.startswith(("topk", "rows"))]
#: Codecs carrying the momentum (CompressionConfig(momentum=...)); checked on the CPU-only
#: device tests (no CUDA run has measured their CUDA-vs-CPU distance yet).
MOMENTUM_SPECS = ["sign+momentum", "blockquant+momentum", "powersgd:rank=2+momentum"]


def _codec(spec: str) -> Codec:
    """``make_codec(spec)``; ``+momentum`` wraps it in a MomentumCodec (beta 0.9)."""
    base, plus, _ = spec.partition("+momentum")
    return MomentumCodec(codec=make_codec(base), momentum=0.9) if plus else make_codec(base)
#: Relative L2 distance allowed between the CUDA and the CPU result of a codec (float
#: reordering; a blockquant/sign/topk element rounding the other way moves one step).
CUDA_VS_CPU = {"none": 1e-6, "rows": 1e-6, "cast": 1e-3, "blockquant": 2e-2, "sign": 2e-2,
               "topk": 2e-2, "powersgd": 1e-3}


def grad(step: int, rank: int = 0, shape: tuple[int, ...] = (96, 80)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(shape, generator=gen)
    x[5:9] = 0.0  # untouched rows, for rows
    return x


def _state_tensors(state: CodecState) -> list[torch.Tensor]:
    return [*state.buffers.values(), *state.scratch.values()]


@contextlib.contextmanager
def _no_host_sync(enabled: bool) -> Iterator[None]:
    """Any CUDA operation that makes the host wait for the device raises inside."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _steps(spec: str, device: torch.device | str, inputs: list[torch.Tensor] | None = None,
           strict: bool = False) -> tuple[list[torch.Tensor], CodecState]:
    """Encode/decode round trips on ``device`` and exchanges on a group of one, one per input
    (default: three gradients). ``strict``: after the first step (which draws PowerSGD's
    ``Q`` on the CPU), no CUDA host synchronisation is allowed."""
    codec = _codec(spec)
    state, ex_state, out = CodecState(), CodecState(), []
    inputs = inputs if inputs is not None else [grad(step).to(device) for step in range(3)]
    for step, x in enumerate(inputs):
        with _no_host_sync(strict and step > 0):
            out += _step(codec, x, state, ex_state)
    for st in (state, ex_state):
        assert st.devices() <= {torch.device(device)}, f"{spec}: state on {st.devices()}"
    return out, state


def _step(codec: Codec, x: torch.Tensor, state: CodecState, ex_state: CodecState) -> list[torch.Tensor]:
    """One encode/decode (``state``) and one exchange on a group of one (``ex_state``) of ``x``."""
    payload, ctx = codec.encode(x, state)
    assert all(piece.device == x.device for piece in payload), codec
    decoded = codec.decode(payload, ctx)
    assert decoded.device == x.device and decoded.shape == x.shape, codec
    work = x.clone()
    compressed_allreduce(codec, work, ex_state, Communicator.alone()).wait()
    assert work.device == x.device, codec
    return [decoded, work]


@pytest.mark.parametrize("spec", META_SPECS + MOMENTUM_SPECS)
def test_codec_state_stays_on_the_meta_device(spec: str) -> None:
    _, state = _steps(spec, "meta")
    if spec not in ("none", "cast:fp16"):
        assert _state_tensors(state), f"{spec} kept no state: the check checked nothing"


@pytest.mark.parametrize("spec", SPECS + MOMENTUM_SPECS)
def test_codecs_allocate_nothing_on_the_default_device(spec: str) -> None:
    inputs = [grad(step) for step in range(3)]
    with torch.device("meta"):  # any allocation without device= lands here
        results, _ = _steps(spec, "cpu", inputs)
    reference, _ = _steps(spec, "cpu")
    for got, want in zip(results, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_dict_restores_onto_another_device() -> None:
    """A residual checkpointed on one device is used on the input's device (meta here)."""
    codec = make_codec("blockquant")
    state = CodecState()
    codec.encode(grad(0), state)
    restored = CodecState()
    restored.load_state_dict(state.state_dict())
    payload, _ = codec.encode(grad(1).to("meta"), restored)
    assert payload[0].device.type == "meta" and restored.buffers["residual"].device.type == "meta"


# -- on CUDA -------------------------------------------------------------------------


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _cuda_codec_body() -> dict[str, list[float]]:
    """In a forked rank: every codec on CUDA vs the CPU, state devices checked in _steps."""
    distances = {}
    for spec in SPECS:
        on_gpu, state = _steps(spec, torch.device("cuda", 0), strict=spec in META_SPECS)
        assert all(t.is_cuda for t in _state_tensors(state)), spec
        on_cpu, _ = _steps(spec, "cpu")
        distances[spec] = [_relative(g.cpu(), c) for g, c in zip(on_gpu, on_cpu)]
    return distances


@pytest.mark.gpu
def test_every_codec_on_cuda_matches_the_cpu() -> None:
    (distances,) = run_ranks(1, _cuda_codec_body, timeout=120)
    for spec, values in distances.items():
        tolerance = CUDA_VS_CPU[spec.split(":")[0]]
        assert max(values) <= tolerance, f"{spec}: CUDA vs CPU relative distance {values}"


def _exchange_body(backend: str | None) -> dict[str, list[float]]:
    """Every codec exchanged over scaleout's Distribution, CUDA tensors vs CPU tensors."""
    env = scaleout.init(backend=backend, timeout=60)
    d = env.create_distribution()
    device = torch.device("cuda", 0)
    distances = {}
    for spec in SPECS:
        codec = make_codec(spec)
        gpu_state, cpu_state, values = CodecState(), CodecState(), []
        for step in range(3):
            x = grad(step, env.rank)
            on_gpu, on_cpu = x.to(device), x.clone()
            compressed_allreduce(codec, on_gpu, gpu_state, d, group=GroupType.DATA).wait(timeout=60)
            compressed_allreduce(codec, on_cpu, cpu_state, d, group=GroupType.DATA).wait(timeout=60)
            assert on_gpu.is_cuda, spec
            values.append(_relative(on_gpu.cpu(), on_cpu))
        assert all(t.is_cuda for t in _state_tensors(gpu_state)), f"{spec}: {gpu_state.devices()}"
        distances[spec] = values
    env.finalize()
    return distances


@pytest.mark.gpu
@pytest.mark.parametrize("world_size, backend", [(1, None), (2, "gloo")])
def test_every_codec_exchanges_cuda_tensors(world_size: int, backend: str | None) -> None:
    """World size 1 with the automatic backend (NCCL for CUDA), 2 ranks sharing the GPU over gloo."""
    for distances in run_ranks(world_size, _exchange_body, backend, timeout=180):
        for spec, values in distances.items():
            tolerance = CUDA_VS_CPU[spec.split(":")[0]]
            assert max(values) <= tolerance, f"{spec}: CUDA vs CPU relative distance {values}"


def test_gram_schmidt_is_orthonormal_and_spans_the_columns() -> None:
    """PowerSGD's device-side orthonormalisation (the CPU uses LAPACK's QR)."""
    from scaleout.compression.powersgd import gram_schmidt

    p = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    p[:, 3] = p[:, 0] + 1e-4 * p[:, 1]  # nearly dependent
    q = gram_schmidt(p)
    torch.testing.assert_close(q.T @ q, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(q @ (q.T @ p), p, atol=1e-4, rtol=0)  # same span
    zero = gram_schmidt(torch.zeros(50, 2))
    assert torch.equal(zero, torch.zeros(50, 2))


def test_powersgd_on_a_device_path_equals_the_cpu_path() -> None:
    """The branch-free path (Gram-Schmidt) gives the CPU's projections, steps included."""
    from unittest import mock

    from scaleout.compression import powersgd

    codec = make_codec("powersgd:rank=3")
    states = CodecState(), CodecState()
    for step in range(3):
        x = grad(step)
        want = codec.decode(*codec.encode(x, states[0]))
        with mock.patch.object(powersgd, "checks_are_free", return_value=False):
            got = codec.decode(*codec.encode(x, states[1]))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
