"""Workloads: what one rank computes per iteration and which gradients it must exchange.

A workload is a sequence of layers in forward order, each with its forward and backward
compute time on one rank, its gradient bytes and an optional optimizer-update time. It
comes from the model table (:mod:`scaleout.sim.models`), from a recorded trace
(:mod:`scaleout.sim.trace`) or from a Chakra trace (:mod:`scaleout.sim.chakra`), and can be
re-scaled to another per-rank batch size or device speed.

Example:
    >>> w = Workload(name="toy", batch_size=8, layers=(
    ...     Layer(name="a", forward_s=1.0, backward_s=2.0, grad_bytes=4),))
    >>> w.scaled(batch_size=16, speed=2.0).compute_s
    3.0
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

__all__ = ["MAX_GRAD_BYTES", "Layer", "Workload", "finite_number"]

#: Above any layer's gradient: Chakra's sizes and torch's element counts are 64-bit.
MAX_GRAD_BYTES = 2**63 - 1


def finite_number(value: object, *, positive: bool = False) -> bool:
    """Whether ``value`` is an int or a float (not a bool), finite (not nan) and >= 0 (> 0
    when ``positive``): what the simulator's times, rates and costs must be."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (0 < value if positive else 0 <= value) and value < math.inf


def _nonneg(owner: str, name: str, value: object) -> None:
    if not finite_number(value):
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer (an Operation with a ParameterSet, in scaleout's words).

    Attributes:
        name: for reports and traces.
        forward_s, backward_s: compute seconds on one rank for one iteration.
        grad_bytes: bytes of its gradients (0: nothing to exchange; at most
            :data:`MAX_GRAD_BYTES`).
        update_s: optimizer update seconds once its gradients arrived.
    """

    name: str
    forward_s: float
    backward_s: float
    grad_bytes: int
    update_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Layer.name must be a str, got {type(self.name).__name__}")
        for field in ("forward_s", "backward_s", "update_s"):
            _nonneg("Layer", field, getattr(self, field))
        if (
            isinstance(self.grad_bytes, bool)
            or not isinstance(self.grad_bytes, int)
            or not 0 <= self.grad_bytes <= MAX_GRAD_BYTES
        ):
            raise ValueError(f"Layer.grad_bytes must be an int from 0 to 2**63 - 1, got "
                             f"{self.grad_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Layers in forward order, for one rank at ``batch_size`` samples.

    Raises:
        ValueError: no layers, a batch size < 1, or duplicate layer names.
    """

    name: str
    layers: tuple[Layer, ...]
    batch_size: int = 1

    def __post_init__(self) -> None:
        if not self.layers or not all(isinstance(layer, Layer) for layer in self.layers):
            raise ValueError(f"Workload {self.name!r} needs at least one Layer")
        if (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, int)
            or self.batch_size < 1
        ):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        twice = sorted(name for name, count in Counter(lay.name for lay in self.layers).items()
                       if count > 1)
        if twice:  # (codecs and the tuner's sizes are looked up by name: they would merge)
            raise ValueError(f"Workload {self.name!r}: layer names must be unique, got "
                             f"{', '.join(map(repr, twice[:5]))} more than once")

    @property
    def forward_s(self) -> float:
        """Forward seconds of all layers."""
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        """Backward seconds of all layers."""
        return sum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        """Forward + backward + updates: one rank's iteration with nothing to wait for.

        A layer without gradients has nothing to update: its ``update_s`` never runs (the
        iteration and the Chakra graph skip it), so it is not counted either; counting it put
        compute above the iteration (efficiency above 100%)."""
        return sum(layer.forward_s + layer.backward_s
                   + (layer.update_s if layer.grad_bytes else 0.0) for layer in self.layers)

    @property
    def grad_bytes(self) -> int:
        """Gradient bytes exchanged per iteration (before compression)."""
        return sum(layer.grad_bytes for layer in self.layers)

    def scaled(self, *, batch_size: int | None = None, speed: float = 1.0) -> Workload:
        """The same model at another per-rank batch size and/or on a faster device.

        Compute time is taken as proportional to the batch (large-batch regime) and
        inversely proportional to ``speed``; gradient bytes and updates do not depend on the
        batch (updates do scale with speed).

        Raises:
            ValueError: a batch size < 1 or a speed that is not a finite number > 0.
        """
        batch = self.batch_size if batch_size is None else batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch!r}")
        if not finite_number(speed, positive=True):
            raise ValueError(f"speed must be a finite number > 0, got {speed!r}")
        factor = batch / self.batch_size / speed
        return Workload(
            name=self.name,
            batch_size=batch,
            layers=tuple(
                replace(
                    layer,
                    forward_s=layer.forward_s * factor,
                    backward_s=layer.backward_s * factor,
                    update_s=layer.update_s / speed,
                )
                for layer in self.layers
            ),
        )
