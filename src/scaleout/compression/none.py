"""The identity codec: the tensor goes on the wire as it is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from scaleout.compression.base import Codec, TensorMeta
from scaleout.compression.state import CodecState

__all__ = ["NoneCodec"]


@dataclass(frozen=True, kw_only=True)
class NoneCodec(Codec):
    """No compression (lossless; tolerance zero up to float summation order).

    The payload is a flat view of the tensor when it is contiguous, so the
    allreduce writes the result straight into the caller's tensor. Works for any
    dtype, including integers (sum only). NaN/Inf propagate as in a plain allreduce.

    Example:
        >>> codec = NoneCodec()
        >>> payload, ctx = codec.encode(torch.ones(2, 2), CodecState())
        >>> codec.decode(payload, ctx).shape
        torch.Size([2, 2])
    """

    name: ClassVar[str] = "none"
    summable: ClassVar[bool] = True

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], TensorMeta]:
        """Return ``[tensor.reshape(-1)]`` (a view when contiguous); see :meth:`Codec.encode`."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"codec 'none' expects a torch.Tensor, got {type(tensor).__name__}")
        return [tensor.detach().reshape(-1)], TensorMeta(tensor.shape, tensor.dtype)

    def decode(self, payload: Sequence[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """Reshape the payload back; see :meth:`Codec.decode`."""
        return payload[0].view(ctx.shape)
