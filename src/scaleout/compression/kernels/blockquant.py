"""Fused Triton kernels of :class:`~scaleout.compression.blockquant.BlockQuantCodec`.

Three passes where the torch path makes about twelve, each reading and writing only what
the codec needs (25M fp32 values on an H100: docs/compression.md has the times):

* :func:`prepare`: ``work = gradient + residual`` and each block's exponent;
* :func:`quantize`: mantissas with shared exponents, and the new residual, finite-masked
  (a non-finite element keeps the previous residual, as :func:`set_residual` does);
* :func:`decode`: ``mantissa * 2**e / L`` per value.

Exponent marks and rounding follow the torch path exactly (module
:mod:`scaleout.compression.blockquant`): the mantissas are bit-identical, the residual may
differ in the last bit where the device fuses a multiply-add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from scaleout.compression.kernels.common import (block_tile, compensated, finite, nan_like,
                                                 pow2, rint, tile)

__all__ = ["decode", "prepare", "quantize"]

# Exponent marks, written out in the kernels: 127 a non-finite block, -128 an all-zero one.


@triton.jit
def step_sizes(e, inv_levels):
    """``2**e / L`` per block: NaN for a non-finite block, zero for an all-zero one."""
    dead = (e == 127) | (e == -128)
    step = tl.where(e == 127, nan_like(e), inv_levels * pow2(tl.where(dead, 0, e)))
    return tl.where(e == -128, 0.0, step)


@triton.jit
def _prepare_kernel(src, res, work, exps, n, nblocks, HAS_RES: tl.constexpr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    x, _ = compensated(src, res, offs, inside, HAS_RES)
    tl.store(work + offs, x, mask=inside)
    amax = tl.max(tl.abs(x), axis=1)
    poisoned = tl.sum(x * 0.0, axis=1)  # NaN iff the block holds NaN or Inf
    # frexp's exponent is the biased one minus 126; subnormals land on the clamp at -126
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    e = tl.minimum(tl.maximum(e, -126), 126)
    e = tl.where(amax == 0.0, -128, e)
    e = tl.where(poisoned != poisoned, 127, e)
    tl.store(exps + rows, e.to(tl.int8), mask=rows < nblocks)


@triton.jit
def _quantize_kernel(work, old, mant, exps, n, nblocks, levels, inv_levels,
                     HAS_OLD: tl.constexpr, FEEDBACK: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    e = tl.load(exps + rows, mask=rows < nblocks, other=-128).to(tl.int32)
    dead = (e == 127) | (e == -128)  # non-finite or all-zero everywhere: mantissa 0
    mult = levels * pow2(-tl.minimum(tl.where(dead, 0, e), 126))
    x = tl.load(work + offs, mask=inside, other=0.0)
    q = rint(x * mult[:, None])
    q = tl.minimum(tl.maximum(q, -levels), levels)
    q = tl.where(dead[:, None], 0.0, q)
    tl.store(mant + offs, q.to(mant.dtype.element_ty), mask=inside)
    if FEEDBACK:
        step = step_sizes(e, inv_levels)
        new = x - q * step[:, None]
        if HAS_OLD:
            keep = tl.load(old + offs, mask=inside, other=0.0)
        else:
            keep = tl.zeros_like(new)
        tl.store(work + offs, tl.where(finite(new), new, keep), mask=inside)


@triton.jit
def _decode_kernel(mant, exps, out, n, nblocks, inv_levels,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, offs, inside = block_tile(n, BLOCK, ROWS)
    e = tl.load(exps + rows, mask=rows < nblocks, other=-128).to(tl.int32)
    step = step_sizes(e, inv_levels)
    q = tl.load(mant + offs, mask=inside, other=0).to(tl.float32)
    tl.store(out + offs, q * step[:, None], mask=inside)


def prepare(source: torch.Tensor, residual: torch.Tensor | None, work: torch.Tensor,
            block: int) -> torch.Tensor:
    """Write ``source + residual`` (float32) into ``work``; return the int8 block exponents.

    Args:
        source: The flat gradient (float32, float16 or bfloat16), contiguous.
        residual: The flat float32 residual, or ``None``.
        work: A flat float32 buffer of the same length (written).
        block: Values per block (a power of two).
    """
    n = source.numel()
    nblocks = max(-(-n // block), 1)
    exps = torch.empty(nblocks, dtype=torch.int8, device=source.device)
    rows, grid = tile(block, nblocks)
    _prepare_kernel[grid](source, residual if residual is not None else work, work, exps, n,
                          nblocks, HAS_RES=residual is not None, BLOCK=block, ROWS=rows)
    return exps


def quantize(work: torch.Tensor, old: torch.Tensor | None, mantissas: torch.Tensor,
             exps: torch.Tensor, levels: int, block: int, feedback: bool) -> None:
    """Mantissas of ``work`` under the (floored, shared) exponents ``exps``; with
    ``feedback``, overwrite ``work`` with the finite-masked new residual (``old`` where
    not finite, zero if ``old`` is ``None``)."""
    n, nblocks = work.numel(), exps.numel()
    rows, grid = tile(block, nblocks)
    _quantize_kernel[grid](work, old if old is not None else work, mantissas, exps, n, nblocks,
                           float(levels), 1.0 / levels, HAS_OLD=old is not None,
                           FEEDBACK=feedback, BLOCK=block, ROWS=rows)


def decode(mantissas: torch.Tensor, exps: torch.Tensor, levels: int, block: int,
           out: torch.Tensor) -> torch.Tensor:
    """``out = mantissa * 2**e / L`` (float32; NaN in non-finite blocks)."""
    rows, grid = tile(block, exps.numel())
    _decode_kernel[grid](mantissas, exps, out, out.numel(), exps.numel(), 1.0 / levels,
                         BLOCK=block, ROWS=rows)
    return out
