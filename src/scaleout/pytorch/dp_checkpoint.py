"""DataParallel's checkpoint surface: weights after pending updates, and codec state.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``synchronize()``,
``module``, ``updates``, ``_session`` and ``_pending_compression_state``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CheckpointSurface"]


class CheckpointSurface(nn.Module):
    """``state_dict`` / ``load_state_dict`` that finish pending updates first, and the codecs'
    error-feedback state as the module's extra state."""

    def module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's own ``state_dict`` (loads into the bare model, keys without
        ``module.``), after finishing pending updates. Codec state travels separately:
        ``state_dict()`` holds it under ``_extra_state``."""
        self.synchronize()
        return self.module.state_dict(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.synchronize()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load weights (and codec state); the optimizer's sharded copies follow them."""
        self.synchronize()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.updates.updater is not None:
            self.updates.updater.refresh_shards()
        return result

    def get_extra_state(self) -> dict[str, Any]:
        """Checkpointed with ``state_dict()``: the codecs' error-feedback state."""
        if self._session is None:
            return {"compression": dict(self._pending_compression_state)}
        return {"compression": self._session.compression_state_dict()}

    def set_extra_state(self, state: Any) -> None:
        """Restored by ``load_state_dict()`` (applied at the first forward if not yet built)."""
        if not isinstance(state, dict) or "compression" not in state:
            raise ValueError("DataParallel extra state must be a dict with a 'compression' entry")
        if self._session is None:
            self._pending_compression_state = dict(state["compression"])
        else:
            self._session.load_compression_state_dict(state["compression"])
