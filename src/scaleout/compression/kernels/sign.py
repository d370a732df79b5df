"""Fused Triton kernels of :class:`~scaleout.compression.sign.SignCodec`.

One pass encodes: ``x = gradient + residual``, the block's scale (RMS or mean magnitude),
the signs packed 8 per byte (least significant bit first, as :func:`pack_bits`), and the
finite-masked new residual ``x - scale * sign``. Decoding, and summing every rank's
gathered payload, are one pass each. The torch path makes about fifteen, with a 256-row
lookup table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scaleout.compression.kernels.common import (block_tile, byte_offsets, compensated, finite,
                                                 pow2, tile)

__all__ = ["decode", "encode", "gather_sum"]


@triton.jit
def _block_scale(x, count, RMS: tl.constexpr):
    """Per row: the RMS or mean magnitude, computed as the torch path does (``block_scales``
    in ``scaleout.compression.sign``): on ``|x| * 2**-e``, ``e`` the exponent of the row's
    largest value clamped to ``[-126, 126]``, scaled back by ``2**e`` (exact steps: ``x * x``
    cannot overflow or underflow). NaN rows give NaN, Inf rows Inf."""
    magnitude = tl.abs(x)
    peak = tl.max(magnitude, axis=1)
    biased = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(biased - 126, -126), 126)
    unit = magnitude * pow2(-e)[:, None]
    if RMS:
        stat = tl.sqrt(tl.sum(unit * unit, axis=1) / count)
    else:
        stat = tl.sum(unit, axis=1) / count
    return stat * pow2(e)


@triton.jit
def _encode_kernel(src, res, new_res, signs, scales, n, nblocks, HAS_RES: tl.constexpr,
                   FEEDBACK: tl.constexpr, RMS: tl.constexpr,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    x, old = compensated(src, res, offs, inside, HAS_RES)
    count = tl.minimum(tl.maximum(n - rows * BLOCK, 1), BLOCK).to(tl.float32)
    scale = _block_scale(x, count, RMS)
    live = rows < nblocks
    tl.store(scales + rows, scale, mask=live)
    negative = x < 0.0
    bits = tl.reshape(negative.to(tl.int32), (ROWS, BLOCK // 8, 8))
    packed = tl.sum(bits << tl.arange(0, 8)[None, None, :], axis=2)
    byte_offs = byte_offsets(rows, BLOCK)
    tl.store(signs + byte_offs, packed.to(tl.uint8), mask=live[:, None])
    if FEEDBACK:
        new = x - tl.where(negative, -scale[:, None], scale[:, None])
        tl.store(new_res + offs, tl.where(finite(new), new, old), mask=inside)


@triton.jit
def _units(packed, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``+1`` / ``-1`` per bit of ``ROWS x BLOCK/8`` bytes, as ``ROWS x BLOCK`` float32."""
    bits = (packed.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
    return tl.reshape(1.0 - 2.0 * bits.to(tl.float32), (ROWS, BLOCK))


@triton.jit
def _decode_kernel(signs, scales, out, n, nblocks, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    live = rows < nblocks
    byte_offs = byte_offsets(rows, BLOCK)
    units = _units(tl.load(signs + byte_offs, mask=live[:, None], other=0), ROWS, BLOCK)
    scale = tl.load(scales + rows, mask=live, other=0.0)
    tl.store(out + offs, units * scale[:, None], mask=inside)


@triton.jit
def _gather_sum_kernel(wire, out, stride, nscale, n, nblocks, RANKS: tl.constexpr,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    live = rows < nblocks
    byte_offs = byte_offsets(rows, BLOCK)
    total = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for r in range(RANKS):  # a compile-time count: one build per world size
        row = wire + r * stride
        word = tl.zeros((ROWS,), dtype=tl.int32)
        for k in tl.static_range(4):  # the float32 scale, little-endian, maybe unaligned
            byte = tl.load(row + rows * 4 + k, mask=live, other=0).to(tl.int32)
            word = word | (byte << (8 * k))
        scale = word.to(tl.float32, bitcast=True)
        units = _units(tl.load(row + nscale + byte_offs, mask=live[:, None], other=0), ROWS, BLOCK)
        total += units * scale[:, None]
    tl.store(out + offs, total, mask=inside)


def encode(source: torch.Tensor, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
           signs: torch.Tensor, scales: torch.Tensor, block: int, rms: bool) -> None:
    """Signs and scales of ``source + residual``; the new residual into ``new_residual``.

    Args:
        source: Flat gradient (float32, float16 or bfloat16), contiguous, non-empty.
        residual: Flat float32 residual, or ``None``.
        new_residual: Flat float32 buffer for ``x - scale * sign`` (non-finite elements keep
            the residual, or zero), or ``None`` without error feedback.
        signs: uint8 buffer of ``blocks * block / 8`` bytes.
        scales: float32 buffer of one scale per block.
        block: Values per scale (a power of two, at least 8).
        rms: Root mean square scale, else mean magnitude.
    """
    n, nblocks = source.numel(), scales.numel()
    rows, grid = tile(block, nblocks)
    spare = source if residual is None else residual
    _encode_kernel[grid](source, spare, new_residual if new_residual is not None else spare,
                         signs, scales, n, nblocks, HAS_RES=residual is not None,
                         FEEDBACK=new_residual is not None, RMS=rms, BLOCK=block, ROWS=rows)


def decode(signs: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """``out = scale * (+1 / -1)`` per value (float32; ``out`` may be shorter than the
    padded blocks)."""
    rows, grid = tile(block, scales.numel())
    _decode_kernel[grid](signs, scales, out, out.numel(), scales.numel(), BLOCK=block, ROWS=rows)
    return out


def gather_sum(wire: torch.Tensor, nscale: int, block: int, out: torch.Tensor) -> torch.Tensor:
    """Sum over ranks of ``scale * sign``, from the gathered ``[ranks, nscale + bytes]`` uint8
    payloads (each row: the float32 scales' bytes, then the packed signs)."""
    ranks, stride = wire.shape
    nblocks = nscale // 4
    rows, grid = tile(block, nblocks)
    _gather_sum_kernel[grid](wire, out, stride, nscale, out.numel(), nblocks, RANKS=ranks,
                             BLOCK=block, ROWS=rows)
    return out
