"""Which codec each tensor gets, and the per-tensor states: the common options.

:class:`CompressionConfig` holds the options every codec shares (a default
codec, per-layer overrides by name glob, a size floor, warm-up steps);
:class:`Compressor` applies it, owns one :class:`CodecState` per tensor name and
checkpoints them all. This is what a data-parallel front end holds.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from scaleout.compression.base import Codec, refuse_bools
from scaleout.compression.exchange import CompressedRequest, compressed_allreduce
from scaleout.compression.momentum import MomentumCodec
from scaleout.compression.none import NoneCodec
from scaleout.compression.registry import make_codec
from scaleout.compression.state import CodecState

__all__ = ["CompressionConfig", "Compressor", "as_config"]

_UNCOMPRESSED = NoneCodec()


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Compression options shared by every codec. Specs are parsed on construction.

    Attributes:
        codec: Default codec (spec string or Codec) for tensors no pattern matches.
        layers: Name glob -> codec (spec or Codec), tried in order, first match
            wins; e.g. ``{"*.bias": "none", "fc*": "powersgd:rank=2"}``.
        min_numel: Tensors with fewer elements go uncompressed.
        warmup_steps: Each tensor's first ``warmup_steps`` exchanges go
            uncompressed (the error-feedback memory starts empty afterwards).
        momentum: ``0`` (default): codecs compress the gradient. ``beta`` in ``(0, 1)``:
            each rank keeps its momentum ``m = beta * m + g``, codecs compress ``m``, and the
            optimizer receives increments that rebuild the exchanged momentum in an
            ``SGD(momentum=beta)`` (:class:`~scaleout.compression.momentum.MomentumCodec`);
            the optimizer must be SGD with this momentum. Sign needs it at the usual lr
            0.05-0.1 with momentum 0.9; other codecs do better on gradients (docs/codecs.md).

    Raises:
        ValueError: For a bad spec or a negative count.
        TypeError: For a spec of the wrong type or a non-string pattern.

    Example:
        >>> cfg = CompressionConfig(codec="topk:ratio=0.01", layers={"*.bias": "none"})
        >>> cfg.select("fc.bias", torch.zeros(4096), step=5).name
        'none'
    """

    codec: str | Codec = "none"
    layers: Mapping[str, str | Codec] = field(default_factory=dict)
    min_numel: int = 1024
    warmup_steps: int = 0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        refuse_bools("CompressionConfig", min_numel=self.min_numel,
                     warmup_steps=self.warmup_steps)
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)) \
                or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {self.momentum!r}")
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.layers, Mapping):
            raise TypeError(f"layers must be a mapping of name glob -> codec, got {type(self.layers).__name__}")
        layers = {}
        for pattern, spec in self.layers.items():
            if not isinstance(pattern, str):
                raise TypeError(f"layer pattern must be a str glob, got {pattern!r}")
            layers[pattern] = make_codec(spec)
        object.__setattr__(self, "codec", self._wrap(make_codec(self.codec)))
        object.__setattr__(self, "layers", MappingProxyType(
            {pattern: self._wrap(codec) for pattern, codec in layers.items()}))

    @property
    def lossy(self) -> bool:
        """Whether any of its codecs (the default one or a layer's) changes the gradients."""
        return any(codec.name != "none" for codec in (self.codec, *self.layers.values()))

    def _wrap(self, codec: Codec) -> Codec:
        """``codec`` compressing the momentum when ``momentum`` is set (not ``none``)."""
        if not self.momentum or codec.name == _UNCOMPRESSED.name or isinstance(codec, MomentumCodec):
            return codec
        return MomentumCodec(codec=codec, momentum=float(self.momentum))

    def codec_for(self, name: str, numel: int, dtype: torch.dtype) -> Codec | None:
        """The codec tensor ``name`` is compressed with after warm-up; ``None``: it goes exact
        (below ``min_numel``, not floating point, or matched to the ``none`` codec)."""
        if numel < self.min_numel or not dtype.is_floating_point:
            return None
        codec = next((c for pattern, c in self.layers.items()
                      if fnmatch.fnmatchcase(name, pattern)), self.codec)
        assert isinstance(codec, Codec)
        return None if codec.name == _UNCOMPRESSED.name else codec

    def select(self, name: str, tensor: torch.Tensor, step: int) -> Codec:
        """The codec for tensor ``name`` at its exchange number ``step``.

        Deterministic in (name, shape, step), so every rank picks the same one.

        Args:
            name: Tensor (parameter or bucket) name.
            tensor: The tensor (only its size and dtype are used).
            step: How many times this tensor has been exchanged before.

        Returns:
            The codec; the uncompressed one below ``min_numel``, during warm-up,
            and for non-floating-point tensors.
        """
        if step < self.warmup_steps:
            return _UNCOMPRESSED
        return self.codec_for(name, tensor.numel(), tensor.dtype) or _UNCOMPRESSED


def as_config(spec: Any, **defaults: Any) -> CompressionConfig:
    """``spec`` as a :class:`CompressionConfig`: a config as it is; a dict of name glob ->
    codec spec as per-layer codecs (others exact); a codec or spec string as the default
    codec, with ``defaults`` for the other options. Parsed now: a bad spec raises here.

    Raises:
        ValueError/TypeError: a bad spec, as :class:`CompressionConfig` raises.
    """
    if isinstance(spec, CompressionConfig):
        return spec
    if isinstance(spec, Mapping):
        return CompressionConfig(codec="none", layers=spec, **defaults)
    return CompressionConfig(codec=spec, **defaults)


class Compressor:
    """Applies a :class:`CompressionConfig` and owns one state per tensor name.

    Args:
        config: A config, or a codec / spec string used as the default codec
            with the default options.

    Example:
        >>> comp = Compressor(CompressionConfig(codec="blockquant", warmup_steps=10))
        >>> for name, p in model.named_parameters():             # doctest: +SKIP
        ...     reqs.append(comp.allreduce(name, p.grad, d, group=GroupType.DATA))
        >>> torch.save(comp.state_dict(), "compression.pt")      # doctest: +SKIP
    """

    def __init__(self, config: CompressionConfig | str | Codec = "none") -> None:
        self.config = as_config(config)
        self._states: dict[str, CodecState] = {}

    def state(self, name: str) -> CodecState:
        """The state of tensor ``name`` (created empty on first use)."""
        if name not in self._states:
            self._states[name] = CodecState()
        return self._states[name]

    def codec_for(self, name: str, tensor: torch.Tensor) -> Codec:
        """The codec the next exchange of ``name`` will use."""
        return self.config.select(name, tensor, self.state(name).step)

    def allreduce(
        self, name: str, tensor: torch.Tensor, comm: Any, *, group: Any, average: bool = True,
        shapes: Any = None,
    ) -> CompressedRequest:
        """:func:`compressed_allreduce` with the codec and state chosen for ``name``.

        Args:
            name: Tensor name (stable across steps and equal on every rank).
            tensor: The gradient; overwritten with the result.
            comm: A ``scaleout`` Distribution.
            group: Group to reduce over.
            average: Divide the sum by the group size.
            shapes: ``tensor`` is a fused bucket of tensors of these shapes.

        Returns:
            The request.
        """
        return compressed_allreduce(
            self.codec_for(name, tensor), tensor, self.state(name), comm, group=group,
            average=average, shapes=shapes,
        )

    def state_dict(self) -> dict[str, Any]:
        """Every tensor's state, checkpointable: ``{"states": {name: state_dict}}``."""
        return {"states": {name: st.state_dict() for name, st in self._states.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (replaces all states).

        Raises:
            ValueError: If the mapping has no ``"states"`` entry.
        """
        if "states" not in state_dict:
            raise ValueError(f"compressor state_dict needs a 'states' entry, got keys {sorted(state_dict)}")
        states = {}
        for name, sd in state_dict["states"].items():
            st = CodecState()
            st.load_state_dict(sd)
            states[name] = st
        self._states = states
