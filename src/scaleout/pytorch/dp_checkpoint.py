"""DataParallel's checkpoint surface: weights after pending updates, and codec state.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``synchronize()``,
``module``, ``updates``, ``_session`` and ``_pending_compression_state``).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

__all__ = ["CheckpointSurface", "fit_compression_state"]


def fit_compression_state(session: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The part of the codec ``state`` (saved by a checkpoint) that ``session`` compresses.

    The rest is reset with a ``UserWarning`` that says why, as a world-size change does: the
    checkpoint was saved with another compression (switched off, another codec or buckets, or
    a codec that ``tune=`` had chosen and this run has not chosen yet).
    """
    have = set(session.compressed_buckets())
    unknown = sorted(set(state) - have)
    if unknown:
        warnings.warn(
            f"the checkpoint's codec state (error-feedback residuals) of {len(unknown)} "
            f"bucket(s) is reset ({unknown[0]}, ...): this session does not compress them (it "
            f"compresses {sorted(have) or 'nothing'}); the checkpoint was saved with other "
            f"compression (switched off since, another codec or buckets, or a codec that tune= "
            f"chose and this run has not chosen yet)", UserWarning, stacklevel=3)
    return {name: entry for name, entry in state.items() if name in have}


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
            self._session.load_compression_state_dict(
                fit_compression_state(self._session, state["compression"]))
