"""Cast codec: send gradients in a narrower float type (fp16 or bf16)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from scaleout.compression.base import (
    Codec,
    Communicator,
    ExchangeGenerator,
    TensorMeta,
    add_residual,
    check_compressible,
    store_residual,
    work_dtype,
)
from scaleout.compression.state import CodecState
from scaleout.core import collectives

__all__ = ["CastCodec", "CAST_DTYPES"]

#: Spec names of the wire dtypes the cast codec accepts.
CAST_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True, kw_only=True)
class CastCodec(Codec):
    """Cast to a 16-bit float type on the wire; summable (the allreduce sums in it).

    Tolerance (one encode/decode, round to nearest): relative error at most
    ``2**-11`` for fp16 and ``2**-8`` for bf16 for values in the type's normal
    range; fp16 subnormals (``|x| < 2**-14``) lose precision to an absolute
    ``2**-25``; fp16 overflows to Inf above 65504. In an exchange each of the ``p``
    ranks sends ``x / p`` (divided before the cast, as PyTorch's ``fp16_compress_hook``),
    so the wire carries the average: it overflows only where the average itself is above
    65504, and gradients below ``p * 2**-24`` flush to zero in fp16. The wire sum is
    itself rounded to the wire type at each hop, so the reduced error grows with
    ``p``; error feedback keeps each rank's own rounding (``x - p * wire``), not the
    rounding of the sum (see docs/compression.md), so it is not exact either. NaN/Inf propagate.

    Args:
        dtype: ``"fp16"`` or ``"bf16"`` (aliases: ``float16``, ``half``,
            ``bfloat16``).
        error_feedback: Keep the rounding error and add it next time (off by
            default, like PyTorch's fp16 hook).

    Raises:
        ValueError: If ``dtype`` is not a known wire type.

    Example:
        >>> codec = CastCodec(dtype="bf16")
        >>> payload, ctx = codec.encode(torch.ones(4), CodecState())
        >>> payload[0].dtype
        torch.bfloat16
    """

    name: ClassVar[str] = "cast"
    summable: ClassVar[bool] = True

    dtype: str = "fp16"
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in CAST_DTYPES:
            raise ValueError(
                f"cast codec: unknown dtype {self.dtype!r}; expected one of {sorted(CAST_DTYPES)}"
            )

    @property
    def wire_dtype(self) -> torch.dtype:
        """The torch dtype that goes on the wire."""
        return CAST_DTYPES[self.dtype]

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], TensorMeta]:
        """Cast to :attr:`wire_dtype`; see :meth:`Codec.encode`.

        The payload is the state's ``"wire"`` scratch buffer (reused every step).
        """
        return [self._to_wire(tensor, state, 1)], TensorMeta(tensor.shape, tensor.dtype)

    def exchange(
        self, tensor: torch.Tensor, state: CodecState, comm: Communicator
    ) -> ExchangeGenerator:
        """One allreduce in the wire dtype of every rank's ``x / ranks`` (as PyTorch's
        ``fp16_compress_hook``: the sum on the wire is the average, which fits fp16 wherever
        the average does); returns that times ``ranks`` in the work dtype (the sum, which
        the caller averages again)."""
        wire = self._to_wire(tensor, state, comm.size)
        summed = yield collectives.allreduce(comm, wire)
        if comm.size == 1:
            return summed
        total = state.work_buffer("sum", summed.numel(), work_dtype(tensor.dtype),
                                  device=summed.device)
        return total.copy_(summed).mul_(comm.size)

    def decode(self, payload: Sequence[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """Cast back to the original dtype; see :meth:`Codec.decode`."""
        return payload[0].to(ctx.dtype).view(ctx.shape)

    def _to_wire(self, tensor: torch.Tensor, state: CodecState, divisor: int) -> torch.Tensor:
        """``tensor / divisor`` (divided in the work dtype, before narrowing) in the wire
        dtype, in the state's ``"wire"`` scratch buffer. With error feedback, the residual
        keeps ``x - divisor * wire``: what this rank's share of the sum lacks."""
        if self.error_feedback:
            flat = add_residual(self.name, tensor, state, True)
            wire = state.work_buffer("wire", flat.numel(), self.wire_dtype, device=flat.device)
            if divisor == 1:
                wire.copy_(flat)
                store_residual(state, flat, wire.to(flat.dtype), True)
            else:
                wire.copy_(flat / divisor)
                store_residual(state, flat, wire.to(flat.dtype).mul_(divisor), True)
            return wire
        check_compressible(self.name, tensor)  # straight from the gradient: one pass
        source = tensor.detach().reshape(-1)
        wire = state.work_buffer("wire", source.numel(), self.wire_dtype, device=source.device)
        if divisor == 1:
            return wire.copy_(source)
        if source.dtype not in (work_dtype(source.dtype), self.wire_dtype):
            # a float16 / bfloat16 gradient for the other wire type: divided in float32 (in its
            # own dtype the quotient was rounded to it before the wire's: bfloat16 through
            # fp16 at 3 ranks, 2.3e-3 off the mean instead of 1.7e-3)
            return wire.copy_(add_residual(self.name, tensor, state, False).div_(divisor))
        return wire.copy_(torch.div(source, divisor))  # (a new tensor: never the gradient)
