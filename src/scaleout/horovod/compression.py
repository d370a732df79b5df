"""Horovod's gradient compression (``hvd.Compression.none`` / ``.fp16``) plus scaleout's codecs.

Horovod's contract: ``compress(tensor) -> (tensor, ctx)`` before the allreduce and
``decompress(tensor, ctx)`` after it; the compressed tensors are summed on the wire.
:meth:`Compression.codec` wraps any scaleout codec spec (``"topk:ratio=0.01"``,
``"powersgd:rank=2"``, ...); such a compression runs the codec's own exchange
(:func:`scaleout.compression.compressed_allreduce`) with error feedback kept per tensor name.
"""

from __future__ import annotations

from typing import Any

import torch

from scaleout.compression import Codec, CodecState, make_codec

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "CodecCompression", "Compression"]


class Compressor:
    """Horovod's compressor interface: a pair of static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what :meth:`decompress` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Undo :meth:`compress` on the reduced tensor."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 (and are summed in float16); others unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class CodecCompression:
    """A scaleout codec used as a Horovod compression (Average and Sum allreduces only).

    Args:
        spec: a codec spec such as ``"topk:ratio=0.01"`` or a :class:`Codec`.

    Raises:
        ValueError: an unknown codec spec.

    Example:
        >>> opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.codec("topk:ratio=0.01"))
    """

    def __init__(self, spec: str | Codec) -> None:
        self.codec = make_codec(spec)
        self.states: dict[str, CodecState] = {}

    def state(self, name: str) -> CodecState:
        """The error-feedback state of tensor ``name`` (created on first use)."""
        return self.states.setdefault(name, CodecState())

    def state_dict(self) -> dict[str, Any]:
        """Every tensor's codec state, for a checkpoint."""
        return {name: state.state_dict() for name, state in self.states.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Return to what :meth:`state_dict` returned: tensors it does not name start afresh."""
        self.states = {}
        for name, saved in state_dict.items():
            self.state(name).load_state_dict(saved)

    def sync(self) -> None:
        """Nothing: error-feedback residuals are this rank's own corrections (each rank's
        differ), so ``hvd.elastic`` state syncs never give every rank rank 0's."""

    def __repr__(self) -> str:
        return f"Compression.codec({self.codec!r})"


class Compression:
    """The compressions ``DistributedOptimizer`` and ``allreduce`` accept.

    Attributes:
        none: no compression.
        fp16: cast floating tensors to float16 on the wire.
    """

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def codec(spec: str | Codec) -> CodecCompression:
        """A scaleout codec (``"topk:ratio=0.01"``, ``"powersgd"``, ``"sign"`` ...) as a compression."""
        return CodecCompression(spec)
