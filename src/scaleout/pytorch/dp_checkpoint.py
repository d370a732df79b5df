"""DataParallel's checkpoint surface: weights after pending updates, codec state, and the
gradient a replaced plan still owes.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``synchronize()``,
``module``, ``updates``, ``_session``, ``_layers``, ``_compression`` and
``_pending_compression_state``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from scaleout.session.hooks import codec_identity, other_codec

__all__ = ["CheckpointSurface", "fit_compression_state"]


def fit_compression_state(session: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The part of the codec ``state`` (saved by a checkpoint) that ``session`` compresses.

    The rest is reset with a ``UserWarning`` that says why, as a world-size change does: the
    checkpoint was saved with another compression (switched off, another codec or buckets, or
    a codec that ``tune=`` had chosen and this run has not chosen yet), or its bucket with
    another codec or codec options (their residuals, momentum or PowerSGD factors would be
    taken for this codec's: kept before stop 49).
    """
    have = session.compressed_buckets()
    unknown = sorted(set(state) - set(have))
    if unknown:
        warnings.warn(
            f"the checkpoint's codec state (error-feedback residuals) of {len(unknown)} "
            f"bucket(s) is reset ({unknown[0]}, ...): this session does not compress them (it "
            f"compresses {sorted(have) or 'nothing'}); the checkpoint was saved with other "
            f"compression (switched off since, another codec or buckets, or a codec that tune= "
            f"chose and this run has not chosen yet)", UserWarning, stacklevel=3)
    other = sorted(name for name, entry in state.items()
                   if name in have and isinstance(entry, dict) and other_codec(entry, have[name]))
    if other:
        warnings.warn(
            f"the checkpoint's codec state of {len(other)} bucket(s) is reset ({other[0]}, "
            f"...): it was saved by {state[other[0]]['codec']}, and this session compresses "
            f"that bucket with {codec_identity(have[other[0]].state.codec)}", UserWarning,
            stacklevel=3)
    return {name: entry for name, entry in state.items() if name in have and name not in other}


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

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """A state dict without this wrapper's ``_extra_state`` (DDP's ``state_dict()``, whose
        keys start with ``module.`` as these do) loads as one saved with no codec state: the
        owed gradients are dropped and the codecs keep theirs, with a warning when there are
        codecs (since stop 52; ``load_state_dict(strict=True)`` raised "Missing key(s) in
        state_dict: "_extra_state"" on a checkpoint of the same model trained under DDP). A
        ``strict=False`` load, maybe partial, leaves that state as it is."""
        super()._load_from_state_dict(state_dict, prefix, *args)
        key = prefix + "_extra_state"
        if key in state_dict:
            return
        strict, missing = args[1], args[2]  # (local_metadata, strict, missing, unexpected, errors)
        if key in missing:
            missing.remove(key)
        if not strict:  # a partial load leaves the codec state and the owed gradients alone
            return
        if self._compression is not None or (self._session is not None
                                             and self._session.compressed_buckets()):
            warnings.warn("the state dict has no DataParallel codec state (_extra_state: saved "
                          "by DDP, or by a module wrapped without compression): the codecs keep "
                          "their error-feedback state", UserWarning, stacklevel=4)
        self.set_extra_state({"compression": {}, "carry": {}})

    def get_extra_state(self) -> dict[str, Any]:
        """Checkpointed with ``state_dict()``: the codecs' error-feedback state, and the
        averaged gradient a replaced plan still owes (``Layer.carry``, until the next step
        adds it; the same on every rank), keyed ``"<layer name>/<parameter index>"``."""
        carry = {f"{layer.name}/{index}": owed.detach().clone()
                 for layer in self._layers for index, owed in layer.carry.items()}
        compression = (dict(self._pending_compression_state) if self._session is None
                       else self._session.compression_state_dict())
        return {"compression": compression, "carry": carry}

    def set_extra_state(self, state: Any) -> None:
        """Restored by ``load_state_dict()`` (applied at the first forward if not yet built).

        Raises:
            ValueError: see :meth:`check_extra_state`.
        """
        loaded = self._checked_carry(state)
        for layer in self._layers:
            layer.carry.clear()
        for layer, index, owed in loaded:
            layer.carry[index] = owed
        if self._session is None:
            self._pending_compression_state = dict(state["compression"])
        else:
            self._session.load_compression_state_dict(
                fit_compression_state(self._session, state["compression"]))

    def check_extra_state(self, state: Any) -> None:
        """Whether :meth:`set_extra_state` takes ``state``, changing nothing
        (:func:`scaleout.checkpoint.load` asks every module before it restores any).

        Raises:
            ValueError: ``state`` is not such a dict, or its owed gradient names a parameter
                this model does not have, or has another shape.
        """
        self._checked_carry(state)

    def _checked_carry(self, state: Any) -> list[tuple[Any, int, torch.Tensor]]:
        """The owed gradients of extra ``state`` (:meth:`get_extra_state`'s) as (layer,
        parameter index, tensor on the parameter's device), checked."""
        if not isinstance(state, dict) or "compression" not in state:
            raise ValueError("DataParallel extra state must be a dict with a 'compression' entry")
        carry = state.get("carry", {})  # (checkpoints before stop 25 have none)
        layers = {layer.name: layer for layer in self._layers}
        if not isinstance(carry, dict):
            raise ValueError(f"DataParallel extra state's 'carry' must be a dict, got "
                             f"{type(carry).__name__}")
        loaded: list[tuple[Any, int, torch.Tensor]] = []
        for key, owed in carry.items():
            name, _, index = str(key).rpartition("/")
            layer = layers.get(name)
            param = (layer.params[int(index)] if layer is not None and index.isdigit()
                     and int(index) < len(layer.params) else None)
            if param is None or not isinstance(owed, torch.Tensor):
                raise ValueError(f"the checkpoint owes gradient to {key!r}, a parameter this "
                                 f"model does not have (its layers: {sorted(layers)})")
            if owed.shape != param.shape:
                raise ValueError(f"the checkpoint owes gradient of shape {tuple(owed.shape)} "
                                 f"to {key!r}, whose parameter has shape {tuple(param.shape)}")
            loaded.append((layer, int(index), owed.to(param.device, param.dtype)))
        return loaded
