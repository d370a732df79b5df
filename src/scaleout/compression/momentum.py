"""Compress the momentum rather than the gradient (Signum / 1-bit Adam style), for any codec.

Each rank keeps its own momentum ``m = beta * m + g`` and the wrapped codec exchanges
``m`` (its error feedback works on ``m``), so the ranks agree on ``M``, the average of
the compressed momenta. What goes to the optimizer is not ``M`` but the increment
``M_t - beta * M_(t-1)``: an ``SGD(momentum=beta)`` (dampening 0) then holds ``M_t`` in its
momentum buffer exactly (by induction from ``buf_1 = M_1``), so the user keeps the
optimizer and hyperparameters they know while the codec sees a smooth, slowly changing
signal instead of the raw gradient. ``CompressionConfig(momentum=beta)`` wraps every
codec it selects in :class:`MomentumCodec`.

Two steps leave the state as it was, as torch leaves SGD's momentum buffer (since stop 49):
a tensor of the bucket whose gradient is zero on every rank (a parameter no rank used)
gets an increment of exactly zero and keeps its state (both momenta, the inner codec's
residual), so DataParallel skips it as torch skips a parameter without ``.grad`` (its lossy
increment made SGD take a full momentum step: 1.3e-2 per idle step); and an exchange whose
sum is not finite anywhere (a step GradScaler skips) keeps every rank's whole state (ranks
with finite gradients folded the skipped step in: 9.9e-2 off). Knowing "zero on every rank"
costs one small allreduce (a flag per tensor), sent before the momenta and read after them.
A used tensor whose gradient is zero everywhere is stepped with that zero increment, as torch
steps it; SGD's buffer has then decayed once more than ``M`` (the increments that follow are
still the averaged gradients, up to the codec's error).

Measured (docs/codecs.md, "Seeds"): sign carrying the momentum loses 2-3 points at lr 0.1
and 0.05 with momentum 0.9 (mean of 3 seeds), where sign of the gradient loses 1-11; it is
warned about either way. blockquant carrying the momentum stays within 0.3 points. Top-k and
PowerSGD did worse carrying the momentum than compressing gradients, and say so in their
:meth:`~scaleout.compression.base.Codec.unsuited`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch

from scaleout.compression.base import (
    Codec,
    Communicator,
    ExchangeGenerator,
    check_compressible,
    check_number,
    checks_are_free,
    update_buffer,
    work_dtype,
)
from scaleout.compression.exchange import Divided, generic_exchange
from scaleout.compression.state import CodecState
from scaleout.core import collectives

__all__ = ["MomentumCodec"]

#: A state buffer's name -> (its tensor before the exchange or ``None``, its scratch's name).
_Saved = dict[str, tuple[Union[torch.Tensor, None], str]]


@dataclass(frozen=True, kw_only=True)
class MomentumCodec(Codec):
    """``codec`` applied to each rank's momentum; the exchange returns momentum increments.

    Tolerance: the inner codec's, on the momentum. With the ``none`` codec the result is
    the averaged gradient up to float rounding.

    State (in the inner codec's :class:`CodecState`, checkpointed with it):
    ``"local_momentum"`` (this rank's ``m``) and ``"delivered"`` (the last exchanged sum
    ``p * M``, equal on every rank), besides the inner codec's own buffers. A tensor whose
    gradient is zero on every rank gets a zero increment and keeps its part of the state
    (both momenta and the inner codec's ``"residual"``); an exchange whose sum is not finite
    keeps the whole state, on every rank.

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
        return self.codec.encode(self._momentum(tensor, state, masked=False)[0], state)

    def decode(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The inner codec's decode (of a momentum)."""
        return self.codec.decode(payload, ctx)

    def exchange(self, tensor: torch.Tensor, state: CodecState,
                 comm: Communicator) -> ExchangeGenerator:
        """The inner exchange of the momentum, then the increment of the sum."""
        return self._exchange(tensor, None, state, comm)

    def exchange_bucket(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]],
                        state: CodecState, comm: Communicator) -> ExchangeGenerator:
        """As :meth:`exchange`, for a fused bucket (the inner codec sees the shapes; a tensor
        of it that is zero on every rank keeps its part of the state alone)."""
        return self._exchange(flat, shapes, state, comm)

    # -- internals -----------------------------------------------------------

    def _exchange(self, tensor: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None,
                  state: CodecState, comm: Communicator) -> ExchangeGenerator:
        counts = [tensor.numel()] if shapes is None else [math.prod(s) for s in shapes]
        touched = _touched(tensor, counts)
        # the state as it was: intact until the next exchange (the new values are written
        # into scratch, and these storages become that scratch only when it is replaced)
        saved = {"residual": (state.buffers.get("residual"), "work"),
                 "delivered": (state.buffers.get("delivered"), "delivered_next")}
        momentum, before = self._momentum(tensor, state, masked=True)
        saved["local_momentum"] = (before, "new_momentum")
        if shapes is None:
            inner = self.codec.exchange(momentum, state, comm)
        else:
            inner = self.codec.exchange_bucket(momentum, shapes, state, comm)
        inner = inner or generic_exchange(self.codec, momentum, state, comm)
        return self._increment(inner, state, saved, touched, counts, comm)

    def _momentum(self, tensor: torch.Tensor, state: CodecState, *,
                  masked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store ``m = beta * m + g`` and return a copy of the new ``m`` as ``tensor``'s shape
        (in the work dtype),
        non-finite values included (so that they reach every rank), in scratch that the inner
        codec may overwrite; and the previous ``m`` (``None`` before the first), intact until
        the next call. ``masked``: the exchange settles the stored ``m`` (:meth:`_settle`);
        else its non-finite values keep the previous ``m``."""
        check_compressible(self.name, tensor)
        grad = tensor.detach().reshape(-1)
        dtype = work_dtype(grad.dtype)
        old = state.buffers.get("local_momentum")
        new = state.work_buffer("new_momentum", grad.numel(), dtype, device=grad.device)
        if old is None:
            new.copy_(grad)
        else:
            torch.add(grad, old.to(grad.device), alpha=self.momentum, out=new)
        # in the work dtype: a float16 / bfloat16 copy rounded m, an error the increment
        # M_t - beta M_(t-1) carried ~1 / (1 - beta) times (bfloat16: 5.4e-3 of the gradient)
        out = state.work_buffer("momentum_out", grad.numel(), dtype, device=grad.device)
        out.copy_(new)
        update_buffer(state, "local_momentum", new, scratch="new_momentum", masked=masked)
        return out.view(tensor.shape), old

    def _increment(self, inner: ExchangeGenerator, state: CodecState, saved: _Saved,
                   touched: torch.Tensor, counts: Sequence[int],
                   comm: Communicator) -> ExchangeGenerator:
        """Run ``inner`` (the sum of momenta), keep the sum, return ``sum - beta * previous``
        (divided as ``inner`` divided it, when it returned :class:`Divided`), then settle the
        state (:func:`_settle`). ``touched``: per tensor, 1 where this rank's gradient is not
        all zero; summed over the ranks by a small allreduce sent first (it has arrived when
        the momenta have: the round that waits for it waits for nothing)."""
        flags = collectives.allreduce(comm, touched)
        result = yield from inner
        touched = yield flags
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
        previous = saved["delivered"][0]
        if previous is not None:
            total.sub_(previous.to(total.device, dtype), alpha=self.momentum / by)
        update_buffer(state, "delivered", keep, scratch="delivered_next", masked=True)
        _settle(state, total, keep, touched.reshape(-1) == 0, counts, saved)
        return Divided(total, by) if divided else total


def _touched(tensor: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Per tensor of a bucket of ``counts`` elements each: 1.0 where ``tensor`` holds a
    non-zero (NaN included) value, else 0.0; on ``tensor``'s device, no host read. (Its
    smallest and largest value: one vectorised pass, where ``torch.any`` of a float tensor
    takes 8x as long on the CPU.)"""
    flat = tensor.detach().reshape(-1)
    zero = flat.new_zeros(())
    bounds = torch.stack([bound for piece in flat.split(list(counts))
                          for bound in (torch.aminmax(piece) if piece.numel() else (zero, zero))])
    return bounds.view(-1, 2).ne(0).any(dim=1).to(torch.float32)


def _settle(state: CodecState, total: torch.Tensor, kept: torch.Tensor, idle: torch.Tensor,
            counts: Sequence[int], saved: _Saved) -> None:
    """What torch's SGD does with its momentum buffer, done to the wrapper's state.

    ``idle`` (per tensor: zero on every rank): its increment becomes exactly 0 and its state
    (this rank's ``m``, the delivered sum, the inner codec's residual) stays as it was
    (``saved``): DataParallel then skips a parameter no rank used (torch: no ``.grad``, no
    step), and steps a used one whose gradient is all zero with 0 (torch: the same). A
    non-finite ``kept`` sum (the same on every rank: a non-finite gradient anywhere reaches
    it) is a step GradScaler skips: every rank keeps its whole state. On the CPU both are
    decided on the host; elsewhere branch-free (``torch.where``, no host sync)."""
    names = [name for name in saved if name in state.buffers]  # (residual: error feedback on)
    if checks_are_free(total):
        finite = bool(torch.isfinite(kept.sum())) or bool(torch.isfinite(kept).all())
        offsets = [0, *itertools.accumulate(counts)]
        for i in (i for i, flag in enumerate(idle.tolist()) if flag):
            total[offsets[i]: offsets[i + 1]] = 0.0
            for name in names if finite else ():
                _put_back_slice(state.buffers[name], saved[name][0], offsets[i], offsets[i + 1])
        for name in names if not finite else ():
            _put_back(state, name, *saved[name])
        return
    if len(counts) > 1:  # per element (expand: views; one cat)
        idle = torch.cat([flag.expand(n) for flag, n in zip(idle, counts)])
    fresh = idle.logical_not().logical_and_(torch.isfinite(kept).all())
    for name in names:
        new, old = state.buffers[name], saved[name][0]
        if old is None:
            new.masked_fill_(fresh.logical_not(), 0.0)
        else:
            torch.where(fresh, new, old.reshape(-1).to(new.device, new.dtype), out=new)
    total.masked_fill_(idle, 0.0)


def _put_back_slice(new: torch.Tensor, old: torch.Tensor | None, start: int, stop: int) -> None:
    """``new[start:stop]`` gets ``old``'s values there (zeros when there was none)."""
    if old is None:
        new[start:stop] = 0.0
    else:
        new[start:stop] = old.reshape(-1)[start:stop].to(new.device, new.dtype)


def _put_back(state: CodecState, name: str, old: torch.Tensor | None, scratch: str) -> None:
    """Make ``old`` the buffer ``name`` again (none if it was ``None``); the storage that
    replaced it becomes the scratch it came from (which held ``old``'s storage)."""
    new = state.buffers.pop(name)
    if old is not None:
        state.buffers[name] = old
    state.scratch[scratch] = new
