"""Triton building blocks shared by the fused codec kernels.

Imported only where Triton is installed (see :mod:`scaleout.compression.kernels`). Every
helper is exact: the codecs' fused paths must give the torch paths' answers.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["block_tile", "byte_offsets", "compensated", "finite", "nan_like", "pow2", "rint", "tile"]

#: Values per program: a tile of ``ROWS = TILE // block`` blocks (at least one block).
TILE = 2048


def tile(block: int, nblocks: int) -> tuple[int, tuple[int]]:
    """``(ROWS, grid)``: blocks per program and the launch grid over ``nblocks`` blocks."""
    rows = max(1, TILE // block)
    return rows, (triton.cdiv(max(nblocks, 1), rows),)


@triton.jit
def rint(x):
    """Round half to even, like ``torch.round`` (libdevice's ``rint`` has no interpreter
    version, so the CPU suite could not check it). Floats of magnitude ``>= 2**23`` are
    integers already, and ``x + 0.5`` could round there."""
    f = tl.floor(x + 0.5)
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    f = tl.where(((f - x) == 0.5) & odd, f - 1.0, f)
    return tl.where(tl.abs(x) >= 8388608.0, x, f)


@triton.jit
def pow2(e):
    """``2.0 ** e`` as float32 for int32 ``e`` in ``[-126, 127]``, built from its bits
    (exact, unlike an ``exp2`` approximation)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def finite(x):
    """Whether each float is finite (``inf - inf`` and ``nan - nan`` are NaN)."""
    return (x - x) == 0.0


@triton.jit
def nan_like(i):
    """A float32 NaN of the shape of the int32 tensor ``i`` (from its bits)."""
    return (tl.zeros_like(i) + 0x7FC00000).to(tl.float32, bitcast=True)


@triton.jit
def block_tile(n, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's ``ROWS`` block indices, the offsets of their values (``ROWS x BLOCK``)
    and which of those lie inside the ``n`` values."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, offs, offs < n


@triton.jit
def byte_offsets(rows, BLOCK: tl.constexpr):
    """Offsets of the packed bytes (8 values each) of blocks ``rows`` (``ROWS x BLOCK/8``)."""
    return rows[:, None] * (BLOCK // 8) + tl.arange(0, BLOCK // 8)[None, :]


@triton.jit
def compensated(src, res, offs, inside, HAS_RES: tl.constexpr):
    """``(gradient + residual, residual)`` as float32 at ``offs`` (zero residual without one)."""
    x = tl.load(src + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_RES:
        old = tl.load(res + offs, mask=inside, other=0.0)
    else:
        old = tl.zeros_like(x)
    return x + old, old
