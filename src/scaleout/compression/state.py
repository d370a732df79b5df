"""Per-tensor codec state: error-feedback residuals, momentum, warm-start factors.

One :class:`CodecState` per compressed tensor (or bucket). Codecs keep whatever
they need in :attr:`CodecState.buffers` under documented names (``"residual"``,
``"momentum"``, ``"q0"``, ...); the state is a plain container so that checkpointing it
does not depend on which codec is in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CodecState"]


@dataclass
class CodecState:
    """Mutable state of one compressed tensor, owned by the caller.

    Attributes:
        step: Number of exchanges this tensor has gone through (drives warm-up).
        buffers: Codec-owned tensors by name, e.g. ``"residual"`` (error
            feedback), ``"momentum"`` (top-k momentum correction), ``"q0"``, ``"q1"``, ...
            (PowerSGD's warm-start factors, one per matrix). Checkpointed.
        scratch: Work buffers reused from step to step (not checkpointed): a fresh
            large tensor costs page faults on every step (~20 ms per 45 MB on the
            development machine), a reused one does not.

    Every tensor a codec keeps here lives on the device of the tensor it compresses
    (:meth:`work_buffer` takes that device; ``tests/test_gpu_codecs.py`` checks it).

    Example:
        >>> state = CodecState()
        >>> state.buffers["residual"] = torch.zeros(3)
        >>> restored = CodecState()
        >>> restored.load_state_dict(state.state_dict())
        >>> restored.buffers["residual"].tolist()
        [0.0, 0.0, 0.0]
    """

    step: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    scratch: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def work_buffer(self, name: str, numel: int, dtype: torch.dtype, *,
                    device: torch.device) -> torch.Tensor:
        """The scratch buffer ``name`` of ``numel`` elements on ``device`` (contents undefined).

        Args:
            name: The buffer's name (one per use, e.g. ``"work"``, ``"wire"``).
            numel: Elements.
            dtype: Element type.
            device: Device, normally that of the tensor being compressed (required, so
                that no buffer silently lands on the CPU).

        Returns:
            A 1-D tensor, reused while name, size, dtype and device stay the same.
        """
        buffer = self.scratch.get(name)
        if (buffer is None or buffer.numel() != numel or buffer.dtype != dtype
                or buffer.device != torch.device(device)):
            buffer = self.scratch[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def devices(self) -> set[torch.device]:
        """The devices of every tensor held (buffers and scratch); for checks and tests."""
        return {t.device for t in (*self.buffers.values(), *self.scratch.values())}

    def state_dict(self) -> dict[str, Any]:
        """Return a checkpointable copy of the state.

        Returns:
            ``{"step": int, "buffers": {name: Tensor}}`` with cloned tensors.
        """
        return {
            "step": self.step,
            "buffers": {name: t.detach().clone() for name, t in self.buffers.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`.

        Args:
            state_dict: A mapping with keys ``"step"`` and ``"buffers"``.

        Raises:
            ValueError: If a key is missing or ``step`` is negative.
            TypeError: If a buffer is not a tensor.
        """
        missing = {"step", "buffers"} - set(state_dict)
        if missing:
            raise ValueError(
                f"codec state_dict is missing {sorted(missing)}; expected keys "
                f"'step' and 'buffers', got {sorted(state_dict)}"
            )
        step = int(state_dict["step"])
        if step < 0:
            raise ValueError(f"codec state step must be >= 0, got {step}")
        buffers = {}
        for name, value in state_dict["buffers"].items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"codec state buffer {name!r} must be a torch.Tensor, "
                    f"got {type(value).__name__}"
                )
            buffers[name] = value.detach().clone()
        self.step = step
        self.buffers = buffers
