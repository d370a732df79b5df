"""MLSL-style block quantisation: Dynamic Fixed Point blocks with error feedback.

Each block of ``block_size`` values shares one power-of-two exponent ``e`` chosen
from the block's largest magnitude (``amax < 2**e``); every value is sent as an
integer mantissa ``q = round(x * L / 2**e)`` with ``|q| <= L``.

On the wire the blocks are *summed*, not gathered: the ranks first agree on a
shared exponent per block (a MAX allreduce of one int8 per block), then quantise
with ``L = (2**(bits-1) - 1) // p`` levels so that the integer sum of ``p`` ranks
cannot overflow, and allreduce the integers. ``bits`` is the smallest of 8, 16, 32
that leaves at least ``min_levels`` levels per rank (int8 up to 8 ranks with the
default ``min_levels=15``). docs/compression.md has the measurements behind this
choice (versus gathering int8 blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from scaleout.core.collectives import ReduceOp
from scaleout.compression.base import (
    refuse_bools,
    Codec,
    Communicator,
    ExchangeGenerator,
    TensorMeta,
    checks_are_free,
    add_residual,
    residual_of,
    set_residual,
    store_residual,
    work_dtype,
)
from scaleout.compression.blocks import block_rows
from scaleout.compression.exchange import Divided, average_target
from scaleout.compression.kernels import kernels_for
from scaleout.compression.state import CodecState
from scaleout.core import collectives

__all__ = ["BlockQuantCodec", "BlockQuantCtx"]

#: Exponent of a block holding NaN/Inf: it wins the MAX and decodes to NaN.
EXP_NONFINITE = 127
#: Exponent of an all-zero block: loses every MAX, so it never coarsens others.
EXP_EMPTY = -128
_EXP_MIN, _EXP_MAX = -126, 126

_WIRE_INTS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int8),
    (16, torch.int16),
    (32, torch.int32),
)


@dataclass(frozen=True)
class BlockQuantCtx:
    """Context of a block-quantised tensor.

    Attributes:
        meta: Original shape and dtype.
        exponents: int8 exponent per block (shared across ranks when aligned).
        levels: Mantissa range ``L`` (values are ``q * 2**e / L``).
        block_size: Values per block.
    """

    meta: TensorMeta
    exponents: torch.Tensor
    levels: int
    block_size: int

    @property
    def dtype(self) -> torch.dtype:
        """Original dtype (lets :meth:`Codec.decode_sum` pick the work dtype)."""
        return self.meta.dtype


@dataclass(frozen=True, kw_only=True)
class BlockQuantCodec(Codec):
    """Dynamic Fixed Point quantisation (MLSL), summable after exponent alignment.

    Tolerance: each value is off by at most ``2**(e-1) / L`` where ``e`` is its
    block's (shared) exponent, i.e. at most ``amax / L`` with ``amax`` the largest
    magnitude in the block across ranks. Single process ``L = 127`` (0.79% of the
    block maximum); ``p`` ranks ``L = 127 // p`` with int8 on the wire. Error
    feedback keeps the rest for the next step. Exponents are clamped to
    ``[-126, 126]``, and raised further so that ``L / 2**e`` is finite in the work
    dtype (float32, int8 wire: ``e >= -120``): blocks below ``2**-121`` are quantised
    a little coarser, and values above ``2**126`` saturate (the excess stays in the
    residual). A block holding
    NaN/Inf on any rank decodes to NaN on every rank; the residual keeps its
    previous value there.

    Args:
        block_size: Values per shared exponent (MLSL: 256).
        error_feedback: Keep the quantisation error and add it next time.
        min_levels: Fewest mantissa levels per rank before a wider integer
            type is used on the wire.

    Raises:
        ValueError: If an option is out of range.

    Example:
        >>> codec = BlockQuantCodec()
        >>> payload, ctx = codec.encode(torch.linspace(-1, 1, 300), CodecState())
        >>> payload[0].dtype, ctx.exponents.tolist(), ctx.levels
        (torch.int8, [1, 1], 127)
    """

    name: ClassVar[str] = "blockquant"
    summable: ClassVar[bool] = True
    rounds: ClassVar[int] = 2

    block_size: int = 256
    error_feedback: bool = True
    min_levels: int = 15

    def __post_init__(self) -> None:
        refuse_bools("blockquant", block_size=self.block_size, min_levels=self.min_levels)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"blockquant: block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.min_levels, int) or not 1 <= self.min_levels <= 127:
            raise ValueError(f"blockquant: min_levels must be an int in [1, 127], got {self.min_levels!r}")

    def wire_format(self, ranks: int) -> tuple[int, torch.dtype]:
        """Mantissa levels per rank and integer wire dtype for a sum over ``ranks``.

        Args:
            ranks: Number of ranks whose mantissas are summed.

        Returns:
            ``(levels, dtype)``.

        Raises:
            ValueError: If ``ranks < 1`` or no integer type is wide enough.
        """
        if ranks < 1:
            raise ValueError(f"blockquant: ranks must be >= 1, got {ranks}")
        for bits, dtype in _WIRE_INTS:
            levels = (2 ** (bits - 1) - 1) // ranks
            if levels >= self.min_levels:
                return levels, dtype
        raise ValueError(f"blockquant: {ranks} ranks leave fewer than {self.min_levels} int32 levels")

    def exponents(self, flat: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """Per-block exponent of a flat work-dtype tensor (int8, see module doc).

        ``scratch``, a buffer like ``flat``, receives ``|flat|`` (else a temporary does).
        """
        magnitudes = torch.abs(flat, out=scratch) if scratch is not None else flat.abs()
        amax = torch.zeros(self._num_blocks(flat.numel()), dtype=flat.dtype, device=flat.device)
        for values, rows in block_rows(magnitudes, self.block_size):
            torch.amax(values, dim=1, out=amax[rows])  # |x| then max: ~5x faster than aminmax
        exp = torch.frexp(amax).exponent.clamp(_EXP_MIN, _EXP_MAX)
        exp = torch.where(amax == 0, torch.full_like(exp, EXP_EMPTY), exp)
        exp = torch.where(torch.isfinite(amax), exp, torch.full_like(exp, EXP_NONFINITE))
        return exp.to(torch.int8)

    def quantize(
        self, tensor: torch.Tensor, state: CodecState, exponents: torch.Tensor | None, ranks: int
    ) -> tuple[list[torch.Tensor], BlockQuantCtx]:
        """Encode with given (shared) exponents and headroom for ``ranks`` ranks.

        Args:
            tensor: The gradient; not modified.
            state: Its codec state (residual read and updated).
            exponents: int8 exponent per block, at least each block's own
                (e.g. the MAX over ranks); ``None`` uses the local ones.
            ranks: Number of ranks whose mantissas will be summed.

        Returns:
            ``([mantissas], ctx)``; mantissas are ``tensor.numel()`` integers.
        """
        flat, own, kernels = self._compensate(tensor, state, None, local=exponents is None)
        return self._quantize_and_remember(flat, own if exponents is None else exponents, ranks,
                                           TensorMeta(tensor.shape, tensor.dtype), state,
                                           saturate=exponents is not None, kernels=kernels)

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], BlockQuantCtx]:
        """Encode with local exponents and ``L = 127``; see :meth:`Codec.encode`."""
        return self.quantize(tensor, state, None, 1)

    def decode(self, payload: Sequence[torch.Tensor], ctx: BlockQuantCtx) -> torch.Tensor:
        """Mantissas (or their sum) times ``2**e / L``; see :meth:`Codec.decode`."""
        kernels = kernels_for(self.name, payload[0].device, ctx.meta.dtype, ctx.block_size)
        return self._decode_flat(payload[0], ctx, kernels=kernels).to(ctx.meta.dtype).view(ctx.meta.shape)

    def exchange(
        self, tensor: torch.Tensor, state: CodecState, comm: Communicator
    ) -> ExchangeGenerator:
        """Two rounds: MAX-allreduce the exponents, then SUM-allreduce mantissas."""
        ranks = comm.size
        flat, exponents, kernels = self._compensate(tensor, state, "quantized")
        exponents = yield collectives.allreduce(comm, exponents, ReduceOp.MAX)
        payload, ctx = self._quantize_and_remember(
            flat, exponents, ranks, TensorMeta(tensor.shape, tensor.dtype), state, saturate=False,
            kernels=kernels)
        summed = yield collectives.allreduce(comm, payload[0], ReduceOp.SUM)
        if kernels is not None:
            return self._decode_flat(summed, ctx, out=state.work_buffer(
                "quantized", summed.numel(), flat.dtype, device=flat.device), kernels=kernels)
        # the average straight into the tensor where it can take it: no pass of its own
        out = average_target(tensor, flat.dtype, state)
        return Divided(self._decode_flat(summed, ctx, out=out, divisor=ranks), ranks)

    # -- internals -----------------------------------------------------------
    #
    # Every pass over the gradient costs CPU that, on a busy machine, training would have
    # used; the hot path makes about seven: add the residual, |x| into scratch, max per block,
    # scale, round, narrow to the wire type, and the residual (one multiply-add, in place).

    def _compensate(self, tensor: torch.Tensor, state: CodecState, scratch: str | None, *,
                    local: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, ModuleType | None]:
        """``(flat, exponents, kernels)``: gradient plus residual in the work buffer, its
        local block exponents, and the fused kernels when they serve (one pass for both),
        else ``None`` (torch path; ``scratch`` names a buffer for ``|flat|``; the exponents
        are ``None`` there unless ``local``)."""
        kernels = kernels_for(self.name, tensor.device, tensor.dtype, self.block_size)
        if kernels is None:
            flat = add_residual(self.name, tensor, state, self.error_feedback)
            if not local:
                return flat, None, None
            buffer = None if scratch is None else state.work_buffer(
                scratch, flat.numel(), flat.dtype, device=flat.device)
            return flat, self.exponents(flat, buffer), None
        residual = residual_of(self.name, tensor, state, self.error_feedback)
        flat = state.work_buffer("work", tensor.numel(), torch.float32, device=tensor.device)
        exponents = kernels.prepare(tensor.detach().reshape(-1), residual, flat, self.block_size)
        return flat, exponents, kernels

    def _num_blocks(self, numel: int) -> int:
        return max(-(-numel // self.block_size), 1)

    @staticmethod
    def _step_sizes(exp: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
        """Value of one mantissa step per block, ``2**e / L`` (NaN for non-finite blocks)."""
        step = torch.ldexp(torch.full(exp.shape, 1.0 / levels, dtype=dtype, device=exp.device),
                           exp.to(dtype))
        return torch.where(exp == EXP_NONFINITE, torch.full_like(step, float("nan")), step)

    def _quantize_and_remember(
        self, flat: torch.Tensor, exponents: torch.Tensor, ranks: int, meta: TensorMeta,
        state: CodecState, *, saturate: bool, kernels: ModuleType | None = None,
    ) -> tuple[list[torch.Tensor], BlockQuantCtx]:
        """Quantise ``flat`` (compensated, owned by us) and keep ``flat - sent`` as residual."""
        levels, wire = self.wire_format(ranks)
        blocks = self._num_blocks(flat.numel())
        if exponents.shape != (blocks,):
            raise ValueError(f"blockquant: expected {blocks} block exponents, got shape {tuple(exponents.shape)}")
        exp = _floor_exponents(exponents.to(torch.int32), levels, flat.dtype)
        if kernels is not None:  # one fused pass: mantissas and the finite-masked residual
            mantissas = state.work_buffer("mantissas", flat.numel(), wire, device=flat.device)
            ctx = BlockQuantCtx(meta, exp.to(torch.int8), levels, self.block_size)
            old = state.buffers.get("residual") if self.error_feedback else None
            kernels.quantize(flat, None if old is None else old.reshape(-1), mantissas,
                             ctx.exponents, levels, self.block_size, self.error_feedback)
            if self.error_feedback:
                set_residual(state, flat, masked=True)
            return [mantissas], ctx
        bad = exp == EXP_NONFINITE
        host = checks_are_free(flat)  # on a device: no data-dependent branch, same result
        any_bad = bool(bad.any()) if host else False
        # |x| <= amax < 2**e, so |x * L / 2**e| < L: rounding stays within +-L unless the
        # exponent saturated at its maximum (or the caller's exponents are smaller).
        saturate = saturate or not host or bool((exp >= _EXP_MAX).any())
        # The floor keeps L / 2**e finite in the work dtype: one multiply per value.
        mult = torch.ldexp(torch.full(exp.shape, float(levels), dtype=torch.float64, device=exp.device),
                           -exp.clamp(max=_EXP_MAX).to(torch.float64))
        mult = torch.where(bad | (exp == EXP_EMPTY), torch.zeros_like(mult), mult).to(flat.dtype)
        q = state.work_buffer("quantized", flat.numel(), flat.dtype, device=flat.device)
        pairs = list(zip(block_rows(flat, self.block_size), block_rows(q, self.block_size)))
        for (values, rows), (out, _) in pairs:
            torch.mul(values, mult[rows, None], out=out)
        if any_bad:  # on a device, NaN mantissas of a non-finite block are don't-care: it decodes to NaN
            q.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        q.round_()
        if saturate:
            q.clamp_(-levels, levels)
        mantissas = state.work_buffer("mantissas", flat.numel(), wire, device=flat.device)
        mantissas.copy_(q)
        ctx = BlockQuantCtx(meta, exp.to(torch.int8), levels, self.block_size)
        if self.error_feedback and any_bad:
            store_residual(state, flat, self._decode_flat(mantissas, ctx), True)
        elif self.error_feedback:  # residual = flat - q * 2**e / L, in place (NaN blocks: kept)
            step = self._step_sizes(exp, levels, flat.dtype)
            for (values, rows), (sent, _) in pairs:
                values.addcmul_(sent, step[rows, None], value=-1.0)
            set_residual(state, flat)
        return [mantissas], ctx

    def _decode_flat(self, mantissas: torch.Tensor, ctx: BlockQuantCtx,
                     out: torch.Tensor | None = None, kernels: ModuleType | None = None,
                     divisor: int = 1) -> torch.Tensor:
        """The values (divided by ``divisor``: the torch path only) into ``out`` or anew."""
        dtype = work_dtype(ctx.meta.dtype)
        if kernels is not None:
            out = torch.empty(mantissas.numel(), dtype=dtype, device=mantissas.device) if out is None else out
            return kernels.decode(mantissas, ctx.exponents, ctx.levels, ctx.block_size, out)
        scale = self._step_sizes(ctx.exponents.to(torch.int32), ctx.levels, dtype)
        if divisor != 1:
            scale.div_(divisor)
        values = mantissas.to(dtype) if out is None else out.copy_(mantissas)
        for segment, rows in block_rows(values, self.block_size):
            segment.mul_(scale[rows, None])
        return values


def _floor_exponents(exp: torch.Tensor, levels: int, dtype: torch.dtype) -> torch.Tensor:
    """Raise block exponents to the least ``e`` for which ``levels / 2**e`` is finite in
    ``dtype`` (float32 with int8 levels: -120), keeping the all-zero and non-finite marks.

    Only blocks whose largest magnitude is below ``2**-121`` (float32 subnormals, nearly)
    change: they are quantised a little coarser; every rank floors alike.
    """
    floor = max(_EXP_MIN, levels.bit_length() - (math.frexp(torch.finfo(dtype).max)[1] - 1))
    return torch.where(exp == EXP_EMPTY, exp, exp.clamp(min=floor))
