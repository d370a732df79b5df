"""Top-k sparsification with error feedback and momentum correction (DGC).

Deep Gradient Compression (Lin et al. 2018): each rank accumulates momentum
``u = m * u + g`` and velocity ``v = v + u`` locally, sends the ``k`` entries of
``v`` with the largest magnitude (values + int32 indices), and clears the sent
entries of both ``u`` and ``v`` (momentum factor masking). With ``momentum=0``
this is plain error-feedback top-k. Payloads are gathered (every rank sends the
same ``k``, so a fixed-size allgather suffices) and scattered into one buffer.

When ``momentum > 0`` the codec *is* the momentum: pair it with an optimizer
without momentum (``torch.optim.SGD(momentum=0)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from scaleout.compression.base import Codec, TensorMeta, compensate, remember, work_dtype
from scaleout.compression.state import CodecState

__all__ = ["TopKCodec"]


@dataclass(frozen=True, kw_only=True)
class TopKCodec(Codec):
    """Send the ``k = max(1, ceil(ratio * n))`` largest-magnitude entries; gathered.

    Tolerance: the sent entries are exact; ``||x - decode(x)||_2**2 <=
    (1 - k/n) * ||x||_2**2`` (what is dropped stays in the residual). NaN and
    Inf rank as the largest magnitudes, so a non-finite entry is sent (up to
    ``k`` of them) and the result is non-finite on every rank; the residual
    keeps its previous value there.

    Wire size: ``8 * k`` bytes (float32 value + int32 index) per rank, gathered
    from every rank; cheaper than a dense fp32 allreduce while ``ratio <
    1 / p`` roughly.

    Args:
        ratio: Fraction of entries sent, in ``(0, 1]``.
        momentum: Momentum-correction factor ``m`` in ``[0, 1)``; 0 disables it.
        error_feedback: Keep unsent entries for the next step.

    Raises:
        ValueError: If an option is out of range.

    Example:
        >>> codec = TopKCodec(ratio=0.5)
        >>> payload, ctx = codec.encode(torch.tensor([0.1, -2.0, 0.3, 1.0]), CodecState())
        >>> payload[0].tolist(), payload[1].tolist()
        ([-2.0, 1.0], [1, 3])
    """

    name: ClassVar[str] = "topk"
    summable: ClassVar[bool] = False

    ratio: float = 0.01
    momentum: float = 0.0
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < float(self.ratio) <= 1.0:
            raise ValueError(f"topk: ratio must be in (0, 1], got {self.ratio!r}")
        if not 0.0 <= float(self.momentum) < 1.0:
            raise ValueError(f"topk: momentum must be in [0, 1), got {self.momentum!r}")

    def k(self, numel: int) -> int:
        """Number of entries sent for a tensor of ``numel`` elements (>= 1 if numel > 0)."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], TensorMeta]:
        """Select the top-k entries; see :meth:`Codec.encode`.

        Returns:
            ``([values float32|float64, indices int32], meta)``, both of length k.
        """
        grad = compensate(self.name, tensor, CodecState(), False)
        if self.momentum:
            old = state.buffers.get("momentum")
            u = grad if old is None else old * self.momentum + grad
            grad = u.clone()
            keep = torch.zeros_like(u) if old is None else old
            state.buffers["momentum"] = torch.where(torch.isfinite(u), u, keep)
        residual = state.buffers.get("residual") if self.error_feedback else None
        velocity = grad if residual is None else grad.add_(residual)
        k = self.k(velocity.numel())
        indices = torch.topk(velocity.abs(), k, sorted=False).indices
        indices, _ = torch.sort(indices)
        values = velocity[indices]
        sent = torch.zeros_like(velocity).index_put_((indices,), values)
        remember(state, velocity, sent, self.error_feedback)
        if self.momentum:
            state.buffers["momentum"].index_fill_(0, indices, 0.0)
        return [values, indices.to(torch.int32)], TensorMeta(tensor.shape, tensor.dtype)

    def decode(self, payload: Sequence[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """Scatter the values into zeros; see :meth:`Codec.decode`."""
        return self.decode_sum([payload], ctx).to(ctx.dtype).view(ctx.shape)

    def decode_sum(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: TensorMeta) -> torch.Tensor:
        """Scatter-add every rank's values into one flat buffer."""
        out = torch.zeros(ctx.numel, dtype=work_dtype(ctx.dtype))
        for values, indices in payloads:
            out.index_add_(0, indices.to(torch.int64), values.to(out.dtype))
        return out
