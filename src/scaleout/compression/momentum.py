"""Compress the momentum rather than the gradient (Signum / 1-bit Adam style), for any codec.

Each rank keeps its own momentum ``m = beta * m + g`` and the wrapped codec exchanges
``m`` (its error feedback works on ``m``), so the ranks agree on ``M``, the average of
the compressed momenta. What goes to the optimizer is not ``M`` but the increment
``M_t - beta * M_(t-1)``: an ``SGD(momentum=beta)`` (dampening 0) then holds ``M_t`` in its
momentum buffer exactly (by induction from ``buf_1 = M_1``), so the user keeps the
optimizer and hyperparameters they know while the codec sees a smooth, slowly changing
signal instead of the raw gradient. ``CompressionConfig(momentum=beta)`` wraps every
codec it selects in :class:`MomentumCodec`.

Measured (docs/codecs.md, "Seeds"): sign carrying the momentum loses 2-3 points at lr 0.1
and 0.05 with momentum 0.9 (mean of 3 seeds), where sign of the gradient loses 1-11; it is
warned about either way. blockquant carrying the momentum stays within 0.3 points. Top-k and
PowerSGD did worse carrying the momentum than compressing gradients, and say so in their
:meth:`~scaleout.compression.base.Codec.unsuited`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from scaleout.compression.base import (
    Codec,
    Communicator,
    ExchangeGenerator,
    check_compressible,
    check_number,
    update_buffer,
    work_dtype,
)
from scaleout.compression.exchange import Divided, generic_exchange
from scaleout.compression.state import CodecState

__all__ = ["MomentumCodec"]


@dataclass(frozen=True, kw_only=True)
class MomentumCodec(Codec):
    """``codec`` applied to each rank's momentum; the exchange returns momentum increments.

    Tolerance: the inner codec's, on the momentum. With the ``none`` codec the result is
    the averaged gradient up to float rounding.

    State (in the inner codec's :class:`CodecState`, checkpointed with it):
    ``"local_momentum"`` (this rank's ``m``) and ``"delivered"`` (the last exchanged sum
    ``p * M``, equal on every rank), besides the inner codec's own buffers.

    Args:
        codec: The codec that carries the momentum (not itself a MomentumCodec).
        momentum: ``beta`` in ``(0, 1)``; must equal the optimizer's (SGD) momentum.

    Raises:
        ValueError: If ``momentum`` is out of range.
        TypeError: If ``codec`` is not a codec, or is a MomentumCodec.

    Example:
        >>> cfg = CompressionConfig(codec="sign", momentum=0.9)     # doctest: +SKIP
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # doctest: +SKIP
    """

    name: ClassVar[str] = "momentum"
    summable: ClassVar[bool] = False

    codec: Codec
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not isinstance(self.codec, Codec) or isinstance(self.codec, MomentumCodec):
            raise TypeError(f"momentum: codec must be a (non-momentum) Codec, got {self.codec!r}")
        check_number("momentum", "momentum", self.momentum)  # ("0.5" failed at an exchange)
        if not 0.0 < self.momentum < 1.0:
            raise ValueError(f"momentum: momentum must be in (0, 1), got {self.momentum!r}")

    @property
    def multi_round(self) -> bool:
        """As the inner codec."""
        return self.codec.multi_round

    def unsuited(self, optimizer: Any, *, compresses_momentum: bool = False) -> str | None:
        """The increments rebuild the momentum only in SGD with the same momentum; then the
        inner codec's limits when it carries a momentum."""
        if optimizer.adaptive:
            return ("compressing the momentum (CompressionConfig(momentum=...)) hands the "
                    "optimizer momentum increments, which an adaptive optimizer does not "
                    "turn back into the momentum; use SGD with the same momentum")
        if abs(optimizer.momentum - self.momentum) > 1e-12:
            return (f"CompressionConfig(momentum={self.momentum}) needs the optimizer's "
                    f"momentum to be the same, got {optimizer.momentum}")
        if optimizer.dampening or optimizer.nesterov:
            return ("the increments rebuild the exchanged momentum in SGD without dampening "
                    "and without Nesterov; set dampening=0, nesterov=False")
        return self.codec.unsuited(optimizer, compresses_momentum=True)

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], Any]:
        """Update this rank's momentum and encode it with the inner codec (no increment:
        that needs the exchanged sum, see :meth:`exchange`)."""
        return self.codec.encode(self._momentum(tensor, state), state)

    def decode(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The inner codec's decode (of a momentum)."""
        return self.codec.decode(payload, ctx)

    def exchange(self, tensor: torch.Tensor, state: CodecState,
                 comm: Communicator) -> ExchangeGenerator:
        """The inner exchange of the momentum, then the increment of the sum."""
        momentum = self._momentum(tensor, state)
        inner = self.codec.exchange(momentum, state, comm)
        return self._increment(inner or generic_exchange(self.codec, momentum, state, comm), state)

    def exchange_bucket(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]],
                        state: CodecState, comm: Communicator) -> ExchangeGenerator:
        """As :meth:`exchange`, for a fused bucket (the inner codec sees the shapes)."""
        momentum = self._momentum(flat, state)
        inner = self.codec.exchange_bucket(momentum, shapes, state, comm)
        return self._increment(inner or generic_exchange(self.codec, momentum, state, comm), state)

    # -- internals -----------------------------------------------------------

    def _momentum(self, tensor: torch.Tensor, state: CodecState) -> torch.Tensor:
        """Store ``m = beta * m + g`` (non-finite values keep the previous ``m``) and return
        a copy of the new ``m`` as ``tensor``'s shape, non-finite values included (so that
        they reach every rank), in scratch that the inner codec may overwrite."""
        check_compressible(self.name, tensor)
        grad = tensor.detach().reshape(-1)
        dtype = work_dtype(grad.dtype)
        old = state.buffers.get("local_momentum")
        new = state.work_buffer("new_momentum", grad.numel(), dtype, device=grad.device)
        if old is None:
            new.copy_(grad)
        else:
            torch.add(grad, old.to(grad.device), alpha=self.momentum, out=new)
        out = state.work_buffer("momentum_out", grad.numel(), grad.dtype, device=grad.device)
        out.copy_(new)
        update_buffer(state, "local_momentum", new, scratch="new_momentum")
        return out.view(tensor.shape)

    def _increment(self, inner: ExchangeGenerator, state: CodecState) -> ExchangeGenerator:
        """Run ``inner`` (the sum of momenta), keep the sum, return ``sum - beta * previous``
        (divided as ``inner`` divided it, when it returned :class:`Divided`)."""
        result = yield from inner
        divided = isinstance(result, Divided)
        total, by = (result.tensor, result.by) if divided else (result, 1)
        total = total.reshape(-1)
        dtype = work_dtype(total.dtype)
        total = total.to(dtype)
        keep = state.work_buffer("delivered_next", total.numel(), dtype, device=total.device)
        if by != 1:  # kept as the sum
            torch.mul(total, by, out=keep)
        else:
            keep.copy_(total)
        previous = state.buffers.get("delivered")
        if previous is not None:
            total.sub_(previous.to(total.device, dtype), alpha=self.momentum / by)
        update_buffer(state, "delivered", keep, scratch="delivered_next")
        return Divided(total, by) if divided else total
