"""1-bit sign compression with a per-block scale and error feedback (EF-SignSGD).

Each block of ``block_size`` values is sent as its signs, packed 8 per byte, and
one scale (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"; per-block rather
than per-tensor scale, as in 1-bit SGD's per-column quantisation). Payloads are
gathered: a sum of signs is not a sign.

The scale is the block's root mean square by default (``scale="rms"``: the decoded block
has the input's L2 norm), not its mean magnitude (``scale="mean"``, the one-step
L2-optimal scale of the paper). With the mean, a block's few large values are paid out at
the block's *mean*, so their error-feedback residual grows until the block's mean catches
up: the residual concentrates on them, the blocks grow heavy-tailed, the codec keeps less
and less of them, and the residual ends several times the gradient. The optimizer then
runs on weights displaced by ``lr / (1 - momentum) * residual``: at lr 0.1 with momentum
0.9 training diverges (digits MLP, 2 ranks: 17% against 92% uncompressed; docs/codecs.md
has the measurements). The RMS pays large values out faster and the residual stays nearer
the gradient's size (2.3x instead of 5.8x late in training, in the probe of docs/codecs.md).
That alone is not enough under momentum 0.9 at lr 0.1 (85% against 96%), and compressing
the momentum instead (``CompressionConfig(momentum=0.9)``) still loses 2-3 points on the
mean of 3 seeds: :meth:`SignCodec.unsuited` warns under any SGD momentum; sign is for
plain SGD.

The codec runs its own one-round exchange so that a step costs a few passes over
reused buffers: signs are packed 8 to a byte (:mod:`scaleout.compression.bits`), and
unpacked with a 256-entry table of ``+-1`` rows; every rank's ``scale * sign`` is
accumulated with one fused multiply-add per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from scaleout.compression.base import (
    refuse_bools,
    Codec,
    Communicator,
    ExchangeGenerator,
    TensorMeta,
    add_residual,
    residual_of,
    set_residual,
    work_dtype,
)
from scaleout.compression.bits import bit_table, pack_bits, unpack_bits
from scaleout.compression.blocks import block_rows
from scaleout.compression.exchange import Divided, average_target
from scaleout.compression.kernels import kernels_for
from scaleout.compression.masks import negative_into
from scaleout.compression.state import CodecState
from scaleout.core import collectives

__all__ = ["SignCodec", "pack_bits", "unpack_bits"]

@functools.lru_cache(maxsize=None)
def _units(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]`` on ``device``: row ``b`` holds ``+1`` / ``-1`` for the 8 bits of byte ``b``."""
    return 1.0 - 2.0 * bit_table(device).to(dtype)


_SCALES = ("rms", "mean")


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the scales on the wire for gradients of ``dtype``: float64 for float64 (a
    float32 scale would overflow above ~3e38 and flush below ~1e-45), else float32 (which
    holds every float32, float16 and bfloat16 block's RMS and mean magnitude)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_scales(magnitude: torch.Tensor, rms: bool) -> torch.Tensor:
    """Per row of ``magnitude`` (``[blocks, values]`` of ``|x|``, float32 or float64;
    overwritten): the RMS or the mean of the row.

    The row is first scaled by ``2**-e``, ``e`` the exponent of its largest value (clamped
    so that ``2**-e`` is a normal float), and the statistic scaled back by ``2**e``: exact
    power-of-two steps, so that ``x * x`` neither overflows nor underflows and the RMS is
    right to rounding whenever it is representable (it lies between ``peak / sqrt(values)``
    and ``peak``). The fused kernels use the same formula. A row holding NaN gets NaN, one
    holding Inf (and no NaN) Inf; rows without values: 0.
    """
    if magnitude.numel() == 0:
        return torch.zeros(magnitude.shape[0], dtype=magnitude.dtype, device=magnitude.device)
    peak = magnitude.amax(dim=1, keepdim=True)
    limit = 1022 if magnitude.dtype == torch.float64 else 126  # 2**+-limit: normal floats
    exponent = torch.frexp(peak).exponent.clamp_(-limit, limit)
    magnitude.mul_(_pow2(exponent.neg(), magnitude.dtype))
    if rms:
        stat = magnitude.mul_(magnitude).mean(dim=1, keepdim=True).sqrt_()
    else:
        stat = magnitude.mean(dim=1, keepdim=True)
    return stat.mul_(_pow2(exponent, magnitude.dtype)).view(-1)


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2.0 ** exponent`` in ``dtype`` (float32 or float64) for integer exponents in its
    normal range, built from the bits (exact)."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


@dataclass(frozen=True, kw_only=True)
class SignCodec(Codec):
    """Signs (1 bit each) times a per-block scale (RMS or mean magnitude); gathered.

    Tolerance: per block, the decode has the input's L2 norm (``scale="rms"``), so
    ``||x - decode(x)||_2 <= sqrt(2) ||x||_2``; with ``scale="mean"`` it has the input's
    L1 norm and ``||x - decode(x)||_2 <= ||x||_2`` (a contraction). Either is exact for
    blocks whose values share one magnitude.
    Error feedback carries the rest. Zeros are sent as ``+scale`` (the residual
    corrects them). A block holding NaN/Inf decodes to non-finite values on every
    rank (its scale is non-finite); the residual keeps its previous value there.

    Wire size: ``ceil(n / 8)`` bytes of signs plus 4 bytes per block (about 28x
    smaller than fp32 with the default 256-value blocks); 8 bytes per block for float64
    gradients, whose scales go as float64. The scale is computed on the block scaled by a
    power of two near its largest value (:func:`block_scales`), so the L2 norm is preserved
    for every finite block whose norm is representable in the gradient's dtype (no overflow
    or underflow of ``x * x``).

    Args:
        block_size: Values per scale; a multiple of 8.
        scale: ``"rms"`` (root mean square of the block, the default) or ``"mean"``
            (mean magnitude); see the module doc for why the default is the RMS.
        error_feedback: Keep the error and add it next time (strongly advised).

    Raises:
        ValueError: If ``block_size`` is not a positive multiple of 8, or ``scale`` is
            not ``"rms"`` or ``"mean"``.

    Example:
        >>> codec = SignCodec(block_size=8, scale="mean")
        >>> payload, ctx = codec.encode(torch.tensor([1.0, -3.0]), CodecState())
        >>> codec.decode(payload, ctx).tolist()
        [2.0, -2.0]
    """

    name: ClassVar[str] = "sign"
    summable: ClassVar[bool] = False

    block_size: int = 256
    scale: str = "rms"
    error_feedback: bool = True

    def __post_init__(self) -> None:
        refuse_bools("sign", block_size=self.block_size)
        if not isinstance(self.block_size, int) or self.block_size < 8 or self.block_size % 8:
            raise ValueError(f"sign: block_size must be a positive multiple of 8, got {self.block_size!r}")
        if self.scale not in _SCALES:
            raise ValueError(f"sign: scale must be one of {', '.join(_SCALES)}, got {self.scale!r}")

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], TensorMeta]:
        """Pack the signs and per-block scales; see :meth:`Codec.encode`.

        Returns:
            ``([signs uint8, scales], meta)``: scales in float32, or float64 for a float64
            tensor (:func:`scale_dtype`).
        """
        meta = TensorMeta(tensor.shape, tensor.dtype)
        kernels = kernels_for(self.name, tensor.device, tensor.dtype, self.block_size)
        if kernels is not None:
            signs, scales = self._encode_fused(kernels, tensor, state)
            return [signs.clone(), scales], meta
        flat = add_residual(self.name, tensor, state, self.error_feedback)
        signs, scales = self._encode_flat(flat, state)
        units = self._units_into(signs, state, flat.dtype)
        self._settle_residual(flat, units, scales, state)
        return [signs.clone(), scales], meta

    def decode(self, payload: Sequence[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """``scale * (+1 / -1)`` per value; see :meth:`Codec.decode`."""
        signs, scales = payload
        dtype = work_dtype(ctx.dtype)
        kernels = kernels_for(self.name, signs.device, ctx.dtype, self.block_size)
        if kernels is not None:
            out = torch.empty(ctx.numel, dtype=dtype, device=signs.device)
            return kernels.decode(signs, scales.to(dtype), self.block_size, out).to(ctx.dtype).view(ctx.shape)
        units = _units(dtype, signs.device)[signs.long()].view(-1, self.block_size)
        values = units.mul_(scales.to(dtype)[:, None]).reshape(-1)[: ctx.numel]
        return values.to(ctx.dtype).view(ctx.shape)

    def exchange(
        self, tensor: torch.Tensor, state: CodecState, comm: Communicator
    ) -> ExchangeGenerator:
        """One allgather of every rank's scales and signs, then ``sum scale * sign``."""
        kernels = kernels_for(self.name, tensor.device, tensor.dtype, self.block_size)
        if kernels is not None:
            return (yield from self._exchange_fused(kernels, tensor, state, comm))
        flat = add_residual(self.name, tensor, state, self.error_feedback)
        signs, scales = self._encode_flat(flat, state)
        nscale = scales.numel() * scales.element_size()
        wire = state.work_buffer("wire", nscale + signs.numel(), torch.uint8, device=flat.device)
        wire[:nscale].copy_(scales.view(torch.uint8))
        wire[nscale:].copy_(signs)
        gathered = yield collectives.allgather(comm, wire)
        rows = gathered.view(comm.size, -1)
        # Each rank's scale * sign, divided by the group's size, summed straight into the
        # tensor where it can take them (its whole blocks; the short last one apart): the
        # average, with no pass of its own.
        out = average_target(tensor, flat.dtype, state)
        parts = block_rows(out, self.block_size)
        for rank, row in enumerate(rows):
            their_scales = row[:nscale].clone().view(scales.dtype).to(flat.dtype)[:, None]
            their_scales.div_(comm.size)
            units = self._units_into(row[nscale:], state, flat.dtype).view(-1, self.block_size)
            for target, blocks in parts:
                if rank == 0:
                    torch.mul(units[blocks, :target.shape[1]], their_scales[blocks], out=target)
                else:
                    target.addcmul_(units[blocks, :target.shape[1]], their_scales[blocks])
            if rank == comm.rank:
                self._settle_residual(flat, units.view(-1), scales, state)
        return Divided(out, comm.size)

    def unsuited(self, optimizer: Any, *, compresses_momentum: bool = False) -> str | None:
        """Adaptive optimizers and SGD with momentum, whether the gradient or the momentum is
        compressed. See docs/codecs.md for the measurements."""
        if optimizer.adaptive:
            return ("1-bit signs give every value of a block one magnitude, so an adaptive "
                    "optimizer's per-value second moment sees the block, not the value "
                    "(digits, AdamW lr 1e-3: 2-6 points lost); use SGD, cast or blockquant")
        if not compresses_momentum and optimizer.momentum > 0:
            return (f"compressing gradients under momentum {optimizer.momentum:g} displaces the "
                    "weights by lr / (1 - momentum) x the error-feedback residual (digits MLP, "
                    "lr 0.1: 11 points lost); use CompressionConfig(momentum="
                    f"{optimizer.momentum:g}) to compress the momentum instead")
        if compresses_momentum and optimizer.momentum > 0:
            return ("1-bit signs of the momentum lose 2-3 points under SGD momentum "
                    f"{optimizer.momentum:g} (digits MLP, lr 0.05 and 0.1, mean of 3 "
                    "initialisations; at lr 0.02 it trains slower); use blockquant, or sign "
                    "with plain SGD")
        return None

    # -- internals -----------------------------------------------------------

    def _encode_fused(self, kernels: ModuleType, tensor: torch.Tensor, state: CodecState,
                      wire: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Signs and scales in one fused pass that also settles the residual; into ``wire``
        (scales' bytes, then signs) when given, else into scratch buffers."""
        n = tensor.numel()
        nblocks = max(1, -(-n // self.block_size))
        residual = residual_of(self.name, tensor, state, self.error_feedback)
        if wire is None:
            signs = state.work_buffer("signs", nblocks * self.block_size // 8, torch.uint8,
                                      device=tensor.device)
            scales = torch.empty(nblocks, dtype=torch.float32, device=tensor.device)
        else:
            scales, signs = wire[: 4 * nblocks].view(torch.float32), wire[4 * nblocks:]
        new = (state.work_buffer("work", n, torch.float32, device=tensor.device)
               if self.error_feedback else None)
        kernels.encode(tensor.detach().reshape(-1), residual, new, signs, scales,
                       self.block_size, self.scale == "rms")
        if new is not None:
            set_residual(state, new, masked=True)
        return signs, scales

    def _exchange_fused(self, kernels: ModuleType, tensor: torch.Tensor, state: CodecState,
                        comm: Communicator) -> ExchangeGenerator:
        """:meth:`exchange` with the fused kernels: encode into the wire buffer, gather,
        and sum every rank's ``scale * sign`` in one pass."""
        nblocks = max(1, -(-tensor.numel() // self.block_size))
        nbytes = nblocks * self.block_size // 8
        wire = state.work_buffer("wire", 4 * nblocks + nbytes, torch.uint8, device=tensor.device)
        self._encode_fused(kernels, tensor, state, wire)
        gathered = yield collectives.allgather(comm, wire)
        total = state.work_buffer("sum", nbytes * 8, torch.float32, device=tensor.device)
        kernels.gather_sum(gathered.view(comm.size, -1), 4 * nblocks, self.block_size, total)
        return total[: tensor.numel()]

    def _encode_flat(self, flat: torch.Tensor, state: CodecState) -> tuple[torch.Tensor, torch.Tensor]:
        """Signs (packed, in a scratch buffer) and scales (:func:`scale_dtype`) of ``flat``."""
        n = flat.numel()
        nblocks = max(1, -(-n // self.block_size))
        full = n // self.block_size * self.block_size
        device = flat.device
        magnitude = state.work_buffer("magnitude", n, flat.dtype, device=device)
        torch.abs(flat, out=magnitude)
        parts = [block_scales(magnitude[:full].view(-1, self.block_size), self.scale == "rms")]
        if full < n or n == 0:
            parts.append(block_scales(magnitude[full:].view(1, n - full), self.scale == "rms"))
        scales = torch.cat(parts).to(scale_dtype(flat.dtype))
        bits = state.work_buffer("bits", nblocks * self.block_size, torch.bool, device=device)
        negative_into(flat, bits[:n])
        bits[n:] = False
        signs = pack_bits(bits, out=state.work_buffer("signs", bits.numel() // 8, torch.uint8, device=device))
        return signs, scales

    def _units_into(self, signs: torch.Tensor, state: CodecState, dtype: torch.dtype) -> torch.Tensor:
        """``+1`` / ``-1`` per packed bit (flat, padded to whole blocks), in a scratch buffer."""
        units = state.work_buffer("units", signs.numel() * 8, dtype, device=signs.device)
        torch.index_select(_units(dtype, signs.device), 0, signs.to(torch.int32), out=units.view(-1, 8))
        return units

    def _settle_residual(self, flat: torch.Tensor, units: torch.Tensor, scales: torch.Tensor,
                         state: CodecState) -> None:
        """Keep ``flat - scale * sign`` as the residual (``flat`` is overwritten)."""
        if not self.error_feedback:
            return
        padded = units.view(-1, self.block_size)
        mine = scales.to(flat.dtype)[:, None]
        for target, blocks in block_rows(flat, self.block_size):
            target.addcmul_(padded[blocks, :target.shape[1]], mine[blocks], value=-1.0)
        set_residual(state, flat)
