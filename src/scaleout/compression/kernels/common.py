"""Triton building blocks shared by the fused codec kernels.

Imported only where Triton is installed (see :mod:`scaleout.compression.kernels`). Every
helper is exact: the codecs' fused paths must give the torch paths' answers.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["finite", "nan_like", "pow2", "rint", "tile"]

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
