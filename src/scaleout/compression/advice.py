"""Which optimizer settings a codec converges with: measured limits, checked at construction.

A lossy codec with error feedback delivers every gradient eventually, but late: the
weights the optimizer works on are displaced from where exact training would have them
by about ``lr / (1 - momentum)`` times the error-feedback residual. Where that step is
large, or where the optimizer normalises each coordinate by what the codec delivered
(Adam's second moment sees the codec's noise, not the gradient's), some codecs lose
accuracy. Each codec states its limits in :meth:`Codec.unsuited`, from the convergence
grid of ``tests/test_compression_convergence.py`` (docs/codecs.md has the numbers);
:func:`unsuited` asks every codec of a config, and ``DistributedOptimizer`` warns with its
answer when it is built.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from scaleout.compression.base import Codec
from scaleout.compression.config import CompressionConfig
from scaleout.compression.momentum import MomentumCodec

__all__ = ["ADAPTIVE", "OptimizerTraits", "codec_label", "optimizer_traits", "unsuited", "warn_unsuited"]

#: torch optimizers that divide each coordinate's step by a running second moment.
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
            "SparseAdam", "Adafactor")


@dataclass(frozen=True, kw_only=True)
class OptimizerTraits:
    """What a codec's limits depend on, for one parameter group.

    Attributes:
        name: The optimizer's class name.
        adaptive: Whether it normalises coordinates by a second moment (Adam and kin).
        momentum: The parameter group's momentum (0 without momentum).
        step: The group's effective step ``lr / (1 - momentum)``.
        dampening: SGD's dampening (0 elsewhere).
        nesterov: SGD's Nesterov flag (False elsewhere).
    """

    name: str
    adaptive: bool
    momentum: float
    step: float
    dampening: float = 0.0
    nesterov: bool = False


def optimizer_traits(optimizer: torch.optim.Optimizer) -> list[OptimizerTraits]:
    """The :class:`OptimizerTraits` of each parameter group of a torch optimizer.

    Raises:
        TypeError: If ``optimizer`` is not a torch optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    traits = []
    for group in optimizer.param_groups:
        momentum = float(group.get("momentum", 0.0) or 0.0)
        lr = float(group.get("lr", 0.0))
        step = lr / (1.0 - momentum) if momentum < 1.0 else float("inf")
        traits.append(OptimizerTraits(name=name, adaptive=name in ADAPTIVE, momentum=momentum,
                                      step=step, dampening=float(group.get("dampening", 0.0) or 0.0),
                                      nesterov=bool(group.get("nesterov", False))))
    return traits


def codec_label(codec: Codec) -> str:
    """The codec's name, ``+momentum`` appended when it carries the momentum."""
    return f"{codec.codec.name}+momentum" if isinstance(codec, MomentumCodec) else codec.name


def unsuited(config: CompressionConfig, optimizer: torch.optim.Optimizer) -> list[str]:
    """Why codecs of ``config`` are not expected to converge with ``optimizer`` (one line each).

    Args:
        config: The compression config (its default codec and every per-layer codec).
        optimizer: The torch optimizer that will consume the averaged gradients.

    Returns:
        One message per codec spec with a known problem; empty when none has one.

    Example:
        >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3)       # doctest: +SKIP
        >>> unsuited(CompressionConfig(codec="sign"), opt)            # doctest: +SKIP
        ["codec 'sign' with AdamW: ..."]
    """
    messages: dict[str, str] = {}
    for traits in optimizer_traits(optimizer):  # every parameter group (its own lr)
        for codec in (config.codec, *config.layers.values()):
            reason = codec.unsuited(traits)
            if reason:
                messages.setdefault(f"{codec!r} {reason}",
                                    f"codec {codec_label(codec)!r} with {traits.name}: {reason}")
    return list(messages.values())


def warn_unsuited(config: CompressionConfig, optimizer: torch.optim.Optimizer) -> list[str]:
    """Warn (``UserWarning``) with each message of :func:`unsuited`; return them.

    ``DistributedOptimizer`` calls it when it is built; with a plain torch optimizer (sync
    mode without one) call ``warn_unsuited(model.compression, optimizer)`` yourself.
    """
    messages = unsuited(config, optimizer)
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=3)
    return messages
