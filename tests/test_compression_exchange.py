"""Multi-rank tests of compressed_allreduce over the real communication core.

Every rank must end with bit-identical results; lossless codecs must match the
analytic oracle (every rank's input is a function of its rank); lossy codecs
must respect their stated bounds and, with error feedback, lose nothing over
several steps (what was sent plus every rank's residual is what went in).
"""

from __future__ import annotations

import pytest
import torch

import scaleout
from harness import run_ranks
from scaleout import GroupType
from scaleout.compression import (
    BlockQuantCodec,
    CodecState,
    CompressionConfig,
    Compressor,
    compressed_allreduce,
    make_codec,
    wire_bytes,
)

WORLD_SIZES = [2, 3]
LOSSY = ["cast:fp16", "cast:bf16", "blockquant", "sign", "topk:ratio=0.1", "powersgd:rank=2"]
# Error feedback that loses nothing. (cast's error feedback covers its own rounding
# but not the rounding of the sum in bf16/fp16 on the wire, so it is not listed.)
EF = ["blockquant", "sign", "topk:ratio=0.1", "powersgd:rank=2"]


def grad(rank: int, step: int, shape: tuple[int, ...] = (48, 40)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=gen) * (rank + 1)


def _exchange(spec: str, tensor: torch.Tensor, state: CodecState, d: scaleout.Distribution,
              average: bool = True, poll: bool = False):
    req = compressed_allreduce(make_codec(spec), tensor, state, d, group=GroupType.DATA, average=average)
    if poll:
        while not req.test():
            pass
    else:
        req.wait(timeout=30)
    return tensor, req.stats


def _lossless_body() -> dict[str, torch.Tensor]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    r = env.rank
    out: dict[str, torch.Tensor] = {}
    ints = torch.arange(60, dtype=torch.float32).view(6, 10) % 7 + 3 * r
    out["none"] = _exchange("none", ints.clone(), CodecState(), d)[0]
    out["none-noncontig"] = _exchange("none", ints.clone().t(), CodecState(), d, poll=True)[0]
    out["none-int64-sum"] = _exchange("none", ints.long(), CodecState(), d, average=False)[0]
    out["cast:fp16"] = _exchange("cast:fp16", ints.clone(), CodecState(), d)[0]
    out["cast:bf16-0d"] = _exchange("cast:bf16", torch.tensor(float(r)), CodecState(), d)[0]
    out["topk:ratio=1"] = _exchange("topk:ratio=1", grad(r, 0), CodecState(), d)[0]
    magnitude = torch.where(torch.arange(512) % 3 == 0, -1.0, 1.0) * (r + 1)  # one magnitude per block
    out["sign"] = _exchange("sign", magnitude, CodecState(), d, poll=True)[0]
    u = torch.linspace(-1, 1, 30)
    low_rank = torch.outer(u, grad(r, 0, (20,)))
    out["powersgd"] = _exchange("powersgd:rank=1", low_rank.clone(), CodecState(), d)[0]
    # the average is written into the tensor where it can be (a flat view of the work
    # dtype), else copied from scratch (a transposed view, fp16); the sum is multiplied back
    out["powersgd-noncontig"] = _exchange("powersgd:rank=1", low_rank.clone().t(), CodecState(), d)[0]
    out["powersgd-fp16"] = _exchange("powersgd:rank=1", low_rank.half(), CodecState(), d)[0]
    out["powersgd-sum"] = _exchange("powersgd:rank=1", low_rank.clone(), CodecState(), d,
                                    average=False)[0]
    signed = torch.where(torch.arange(512) % 3 == 0, -1.0, 1.0) * (r + 1)  # (sign's was averaged)
    for spec in ("topk:ratio=1", "sign", "blockquant"):  # their average is written into the tensor
        x = signed.view(32, 16) if spec != "topk:ratio=1" else grad(r, 0)
        out[f"{spec}-sum"] = _exchange(spec, x.clone(), CodecState(), d, average=False)[0]
        out[f"{spec}-noncontig"] = _exchange(spec, x.clone().t(), CodecState(), d)[0]
    out["sign-short-block"] = _exchange("sign", signed[:300].clone(), CodecState(), d)[0]
    out["blockquant-avg"] = _exchange("blockquant", signed.view(32, 16).clone(), CodecState(), d)[0]
    out["empty"] = _exchange("blockquant", torch.zeros(0, 4), CodecState(), d)[0]
    env.finalize()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_lossless_cases_match_the_oracle(world_size: int) -> None:
    results = run_ranks(world_size, _lossless_body, timeout=60)
    for other in results[1:]:
        for key, value in other.items():
            assert torch.equal(value, results[0][key]), f"{key}: ranks disagree"
    got = results[0]
    ranks = range(world_size)
    ints = [torch.arange(60, dtype=torch.float32).view(6, 10) % 7 + 3 * r for r in ranks]
    mean = sum(ints) / world_size
    assert torch.equal(got["none"], mean)
    assert torch.equal(got["none-noncontig"], mean.t())
    assert torch.equal(got["none-int64-sum"], sum(i.long() for i in ints))
    assert torch.equal(got["cast:fp16"], mean)
    assert torch.equal(got["cast:bf16-0d"], torch.tensor(sum(ranks) / world_size))
    assert torch.allclose(got["topk:ratio=1"], sum(grad(r, 0) for r in ranks) / world_size, atol=1e-6)
    signs = torch.where(torch.arange(512) % 3 == 0, -1.0, 1.0)
    assert torch.allclose(got["sign"], signs * sum(r + 1 for r in ranks) / world_size)
    u = torch.linspace(-1, 1, 30)
    want = sum(torch.outer(u, grad(r, 0, (20,))) for r in ranks) / world_size
    assert torch.allclose(got["powersgd"], want, atol=1e-5)
    assert torch.allclose(got["powersgd-noncontig"], want.t(), atol=1e-5)
    assert got["powersgd-fp16"].dtype == torch.float16
    assert torch.allclose(got["powersgd-fp16"].float(), want, atol=1e-2)
    assert torch.allclose(got["powersgd-sum"], want * world_size, atol=1e-5)
    topk_mean = sum(grad(r, 0) for r in ranks) / world_size
    assert torch.allclose(got["topk:ratio=1-sum"], topk_mean * world_size, atol=1e-5)
    assert torch.allclose(got["topk:ratio=1-noncontig"], topk_mean.t(), atol=1e-6)
    sign_mean = signs * sum(r + 1 for r in ranks) / world_size
    assert torch.allclose(got["sign-sum"], sign_mean.view(32, 16) * world_size)
    assert torch.allclose(got["sign-noncontig"], sign_mean.view(32, 16).t())
    assert torch.allclose(got["sign-short-block"], sign_mean[:300])
    # (blockquant rounds these values: its sum and its transposed input against its average)
    assert torch.allclose(got["blockquant-sum"], got["blockquant-avg"] * world_size)
    assert torch.equal(got["blockquant-noncontig"], got["blockquant-avg"].t())
    assert torch.allclose(got["blockquant-avg"], sign_mean.view(32, 16), atol=0.05)
    assert got["empty"].shape == (0, 4)


def _lossy_body(steps: int) -> dict[str, list]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    out: dict[str, list] = {}
    for spec in [*LOSSY, "cast:bf16,error_feedback=on"]:
        state = CodecState()
        results = []
        for step in range(steps):
            results.append(_exchange(spec, grad(env.rank, step), state, d, poll=step % 2 == 1)[0].clone())
        out[spec] = [results, state.buffers.get("residual")]
    env.finalize()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_lossy_codecs_agree_bound_and_lose_nothing(world_size: int) -> None:
    steps = 4
    results = run_ranks(world_size, _lossy_body, steps, timeout=60)
    ranks = range(world_size)
    for spec in results[0]:
        outs = [r[spec][0] for r in results]
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert torch.equal(a, b), f"{spec}: ranks disagree"
        if spec == "blockquant":  # stated bound: amax / (127 // p) per value, first step
            exact = sum(grad(r, 0) for r in ranks) / world_size
            amax = max(grad(r, 0).abs().max() for r in ranks)
            assert (outs[0][0] - exact).abs().max() <= amax / BlockQuantCodec().wire_format(world_size)[0]
        if spec in EF:  # sum over steps of the reduced sum + every rank's residual == all inputs
            sent = sum(o.double() for o in outs[0]) * world_size
            kept = sum(results[r][spec][1].double().view(48, 40) for r in ranks)
            total = sum(grad(r, s).double() for r in ranks for s in range(steps))
            assert torch.allclose(sent + kept, total, atol=1e-3), spec


def _nonfinite_body() -> dict[str, tuple[bool, bool]]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    out = {}
    for spec in LOSSY:
        state = CodecState()
        _exchange(spec, grad(env.rank, 0), state, d)
        x = grad(env.rank, 1)
        if env.rank == env.world_size - 1:
            x[7, 3] = float("nan")
        y = _exchange(spec, x, state, d)[0]
        clean = all(bool(torch.isfinite(b).all()) for b in state.buffers.values())
        out[spec] = (bool(torch.isfinite(y).all()), clean)
    env.finalize()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_nan_on_one_rank_reaches_every_rank_without_poisoning_state(world_size: int) -> None:
    for rank, out in enumerate(run_ranks(world_size, _nonfinite_body, timeout=60)):
        for spec, (finite, clean) in out.items():
            assert not finite, f"rank {rank}, {spec}: NaN on the last rank did not propagate"
            assert clean, f"rank {rank}, {spec}: codec state poisoned by NaN"


def _compressor_body() -> tuple[list[str], list[int]]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    comp = Compressor(CompressionConfig(codec="topk:ratio=0.05", layers={"*.bias": "cast:bf16"},
                                        min_numel=64, warmup_steps=1))
    used, payload = [], []
    for step in range(2):
        for name, shape in (("fc.weight", (32, 32)), ("fc.bias", (100,)), ("tiny.weight", (3,))):
            codec = comp.codec_for(name, torch.zeros(shape))
            req = comp.allreduce(name, grad(env.rank, step, shape), d, group=GroupType.DATA)
            req.wait()
            used.append(codec.name)
            payload.append(req.stats.payload_bytes)
    env.finalize()
    return used, payload


def test_compressor_applies_warmup_size_and_globs() -> None:
    a, b = run_ranks(2, _compressor_body, timeout=60)
    assert a == b
    assert a[0] == ["none", "none", "none", "topk", "cast", "none"]
    assert a[1] == [4096, 400, 12, 8 * 52, 200, 12]


SIZES = {"1 MiB fc (512x512)": (512, 512)}
TABLE_SPECS = ["none", "cast:fp16", "cast:bf16", "blockquant", "sign", "topk:ratio=0.01", "powersgd:rank=4"]


def _bytes_body() -> dict[str, tuple]:
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    out = {}
    for spec in TABLE_SPECS:
        x = grad(env.rank, 0, (512, 512))
        y, stats = _exchange(spec, x, CodecState(), d)
        exact = sum(grad(r, 0, (512, 512)) for r in range(env.world_size)) / env.world_size
        rel = ((y - exact).norm() / exact.norm()).item()
        out[spec] = (stats.payload_bytes, stats.wire_bytes, stats.compression_ratio, stats.wire_ratio, rel,
                     stats.collectives)
    env.finalize()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_on_the_wire(world_size: int) -> None:
    """Prints the table in docs/compression.md (run with -s) and checks the ratios."""
    got = run_ranks(world_size, _bytes_body, timeout=60)[0]
    dense = 512 * 512 * 4
    print(f"\n{world_size} ranks, 512x512 fp32 (1 MiB); one exchange, no error-feedback history")
    print(f"{'codec':18} {'payload B':>10} {'wire B/rank':>12} {'payload x':>9} {'wire x':>7} {'rel err':>8}")
    for spec, (payload, wire, ratio, wratio, rel, _) in got.items():
        print(f"{spec:18} {payload:10d} {wire:12.0f} {ratio:9.1f} {wratio:7.1f} {rel:8.4f}")
    # The rejected alternative, gathering int8 blocks with local exponents and L = 127:
    codec = BlockQuantCodec(error_feedback=False)
    grads = [grad(r, 0, (512, 512)) for r in range(world_size)]
    pays = [codec.encode(g, CodecState()) for g in grads]
    gathered = sum(codec.decode(*p) for p in pays) / world_size
    exact = sum(grads) / world_size
    rel = ((gathered - exact).norm() / exact.norm()).item()
    payload = 512 * 512 + 1024
    print(f"{'blockquant-gather':18} {payload:10d} {wire_bytes('allgather', payload, world_size):12.0f} "
          f"{dense / payload:9.1f} {wire_bytes('allreduce', dense, world_size) / wire_bytes('allgather', payload, world_size):7.1f} {rel:8.4f}")
    assert got["none"][0] == dense and got["none"][4] < 1e-6  # float summation order
    assert got["none"][1] == wire_bytes("allreduce", dense, world_size)
    assert got["cast:fp16"][2] == 2.0
    assert got["blockquant"][0] == 512 * 512 + 1024  # int8 mantissas + one int8 exponent per block
    assert got["blockquant"][2] > 3.98
    assert got["sign"][0] == 512 * 512 // 8 + 4 * 1024
    assert got["topk:ratio=0.01"][0] == 8 * 2622
    assert got["powersgd:rank=4"][0] == 4 * 4 * (512 + 512)
    assert got["blockquant"][4] < 0.06 and got["cast:bf16"][4] < 0.01


# -- fused buckets -------------------------------------------------------------------

BUCKET_SHAPES = [(32, 16), (20,), (8, 40), (3, 2)]  # matrices, a vector, a too-small matrix


def _bucket_body(spec: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three steps of one fused bucket vs the same tensors exchanged one by one."""
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    codec = make_codec(spec)
    bucket_state, states = CodecState(), [CodecState() for _ in BUCKET_SHAPES]
    fused, single = [], []
    for step in range(3):
        parts = [grad(env.rank, step, shape) for shape in BUCKET_SHAPES]
        flat = torch.cat([p.reshape(-1) for p in parts])
        compressed_allreduce(codec, flat, bucket_state, d, group=GroupType.DATA,
                             shapes=BUCKET_SHAPES).wait(timeout=30)
        fused.append(flat)
        for part, state in zip(parts, states):
            compressed_allreduce(codec, part, state, d, group=GroupType.DATA).wait(timeout=30)
        single.append(torch.cat([p.reshape(-1) for p in parts]))
    env.finalize()
    return fused, single


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_powersgd_bucket_equals_tensor_by_tensor(world_size: int) -> None:
    """PowerSGD's batched bucket exchange (two collectives) gives, per tensor, what the
    per-tensor exchange gives: same projections, warm starts and error feedback."""
    per_rank = run_ranks(world_size, _bucket_body, "powersgd:rank=2", timeout=60)
    for fused, single in per_rank:
        for step, (a, b) in enumerate(zip(fused, single)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0][0], other[0]):
            assert torch.equal(a, b)


def test_bucket_shapes_must_cover_the_tensor() -> None:
    class Alone:
        def size(self, group: object) -> int:
            return 1

        def rank(self, group: object) -> int:
            return 0

    with pytest.raises(ValueError, match="shapes"):
        compressed_allreduce(make_codec("powersgd"), torch.zeros(10), CodecState(), Alone(),
                             group=None, shapes=[(2, 3)])
    with pytest.raises(ValueError, match="1-D"):
        compressed_allreduce(make_codec("blockquant"), torch.zeros(2, 3), CodecState(), Alone(),
                             group=None, shapes=[(2, 3)])


def _rows_tensors(rank: int) -> list[torch.Tensor]:
    table = torch.zeros(100, 8)
    table[[rank, 10 + rank, 50]] = grad(rank, 1, (3, 8))  # an embedding: few rows touched
    dense = grad(rank, 2, (6, 5))                         # every row touched: goes whole
    bias = grad(rank, 3, (7,))
    nan_table = torch.zeros(40, 3)
    if rank == 1:
        nan_table[9, 2] = float("nan")
    return [table, dense, bias, nan_table]


def _rows_body(bits_up_to: int) -> dict[str, object]:
    from scaleout.compression import rows

    rows.BITS_UP_TO = bits_up_to  # (this rank's process: 0 takes the byte-per-row path)
    env = scaleout.init(timeout=30)
    d = env.create_distribution(env.world_size, 1)
    tensors = _rows_tensors(env.rank)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    req = compressed_allreduce(make_codec("rows"), flat, CodecState(), d, group=GroupType.DATA,
                               shapes=[tuple(t.shape) for t in tensors])
    req.wait(timeout=30)
    single, stats = _exchange("rows", _rows_tensors(env.rank)[0], CodecState(), d)
    env.finalize()
    return {"bucket": flat, "single": single, "payload": req.stats.payload_bytes,
            "single_payload": stats.payload_bytes}


@pytest.mark.parametrize("bits", [True, False], ids=["bit-flags", "byte-flags"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rows_is_exact_and_sends_only_touched_rows(world_size: int, bits: bool) -> None:
    results = run_ranks(world_size, _rows_body, 16 if bits else 0, timeout=60)
    per_rank = [_rows_tensors(r) for r in range(world_size)]
    want = [sum(ts[i] for ts in per_rank) / world_size for i in range(4)]
    want_flat = torch.cat([w.reshape(-1) for w in want])
    for got in results:
        assert torch.allclose(got["bucket"], want_flat, atol=1e-6, equal_nan=True)
        assert torch.allclose(got["single"], want[0], atol=1e-6)
    nan_at = torch.isnan(results[0]["bucket"][-120:].view(40, 3))
    assert nan_at[9, 2] and nan_at.sum() == 1, "a NaN arrives where it was, as in a dense allreduce"
    touched = len({0, 10, 50} | {r for r in range(world_size)} | {10 + r for r in range(world_size)})
    # round 1: a bit per row of each matrix, a copy for every rank (all-to-all), or (beyond
    # rows.BITS_UP_TO ranks) a byte per row, all-reduced
    def flags(n: int) -> int:
        return -(-n // 8) * world_size if bits else n

    rows = 4 * (touched * 8 + 30 + 7 + 3)  # round 2: touched rows, dense whole, bias, NaN row
    assert results[0]["payload"] == flags(100 + 6 + 40) + rows
    assert results[0]["single_payload"] == flags(100) + 4 * touched * 8


def _rows_model_body(spec: str | None) -> list[torch.Tensor]:
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(200, 6), torch.nn.Flatten(), torch.nn.Linear(24, 3))
    model = DataParallel(net, env.create_distribution(), compression=spec)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    for step in range(3):
        tokens = torch.randint(0, 200, (4, 4), generator=torch.Generator().manual_seed(step * 10 + env.rank))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    out = [p.detach().clone() for p in net.parameters()]
    model.close()
    env.finalize()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_rows_in_data_parallel_trains_like_exact(world_size: int) -> None:
    exact = run_ranks(world_size, _rows_model_body, None, timeout=60)[0]
    rows = run_ranks(world_size, _rows_model_body, "rows", timeout=60)[0]
    for a, b in zip(exact, rows):
        assert torch.allclose(a, b, atol=1e-6)
