"""Error-feedback residuals carried across a re-plan of DataParallel's buckets.

A codec with error feedback keeps, per bucket and rank, what it has not sent yet (its
residual, ``CodecState.buffers["residual"]``): gradient that every later exchange still owes
the model. The autotuner re-plans the buckets (``DataParallel._rebuild``: another codec, other
buckets, or exact gradients again after a codec it timed lost), and a new plan starts with
new codec states, so before this module the residuals were dropped: gradient lost for good,
silently.

Both kinds of residual in scaleout mean the same: ``e_i = compensated_i - sent_i`` on rank
``i`` (sign, blockquant; PowerSGD keeps ``M_i - result / p``), so the mean of the ranks'
residuals is exactly the part of the averaged gradient not delivered yet. Each parameter's
slice of its old bucket's residual goes, after the re-plan:

* into its new bucket's residual when that bucket's codec keeps one (error feedback on): no
  communication; the codec adds it to the next gradient as it adds its own;
* otherwise (exact gradients, or a codec without error feedback) into the parameter's next
  averaged gradient: the slices are averaged over the data group in one all-reduce at the
  re-plan (every rank re-plans at the same point; the slices are taken in the same order
  everywhere), then added once by :func:`scaleout.pytorch.updates.averaged`.

Other codec state (top-k's momentum correction, PowerSGD's warm-start factors, compressed
momentum) is algorithm state of the old codec, not owed gradient; it starts afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scaleout.compression.base import set_residual, work_dtype
from scaleout.core import collectives
from scaleout.core.collectives import Communicator, ReduceOp
from scaleout.pytorch.modules import Layer

__all__ = ["residual_slices", "carry_residuals", "Replanning"]


class Replanning:
    """DataParallel's re-plan and the tuner's surface (a mixin: it uses the model's
    ``_session``, ``_scheduler``, ``_compression``, ``_commit``, ``_forward_order``, ``comm``
    and ``_tuner``)."""

    @property
    def tuning(self) -> Any:
        """What ``tune=`` chose and why (a :class:`~scaleout.sim.tuning.TuneChoice`:
        ``summary()``, ``as_dict()``), or ``None`` before it tuned (or without ``tune=``)."""
        return None if self._tuner is None else self._tuner.choice

    def tune_now(self) -> Any:
        """Tune now (every rank, once, after a measured iteration); returns the choice."""
        if self._tuner is None:
            raise RuntimeError("tune_now() needs DataParallel(..., tune=...)")
        self._tuner.before_forward(self, now=True)
        return self.tuning

    def _rebuild(self, scheduler: Any, compression: Any) -> None:
        """Plan again with new options (the tuner's; every rank, nothing in flight), the
        codecs' residuals carried into the new plan."""
        old = self._session
        assert old is not None
        owed = residual_slices(old)  # (gradient the codecs have not sent yet)
        self._scheduler, self._compression = scheduler, compression
        old.close(reuse=True)  # (its lanes' process groups serve the new plan's)
        self._commit()
        if self._session is not None and self._session is not old:
            carry_residuals(self._session, self._forward_order, owed, self.comm)


def residual_slices(session: Any) -> dict[str, torch.Tensor]:
    """Every compressed bucket's residual, cut per member (by parameter-set name, copies)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in session.compressed_buckets().values():
        residual = bucket.state.codec_state.buffers.get("residual")
        if residual is None:
            continue
        flat = residual.reshape(-1)
        for member in bucket.members:
            first, end = bucket.span(member)
            out[member.name] = flat[first:end].clone()
    return out


def carry_residuals(session: Any, layers: Sequence[Layer], slices: dict[str, torch.Tensor],
                    comm: Communicator) -> None:
    """Give ``slices`` (:func:`residual_slices` of the old plan) to ``session``, the new plan
    of ``layers`` (see the module's docstring). Every rank of ``comm`` calls it at the same
    point with slices of the same names (they come from the same plan)."""
    if not slices:
        return
    kept = _into_new_residuals(session, slices)
    owed = [(layer, index, member.name) for layer in layers
            for index, member in _members(layer) if member.name in slices
            and member.name not in kept]
    if not owed:
        return
    flat = torch.cat([slices[name].reshape(-1) for _, _, name in owed])
    mean = collectives.allreduce(comm, flat, ReduceOp.AVG).wait()
    at = 0
    for layer, index, name in owed:
        size = slices[name].numel()
        share = mean[at:at + size].to(layer.params[index].dtype)
        at += size
        earlier = layer.carry.get(index)  # (a tied weight's two shares add up)
        layer.carry[index] = share if earlier is None else earlier + share


def _members(layer: Layer) -> list[tuple[int, Any]]:
    """(parameter index, parameter set) of a layer's sets and early shares."""
    return [*enumerate(layer.sets), *layer.early.items()]


def _into_new_residuals(session: Any, slices: dict[str, torch.Tensor]) -> set[str]:
    """Write the slices whose new bucket's codec keeps a residual into it; their names."""
    kept: set[str] = set()
    for bucket in session.compressed_buckets().values():
        if not getattr(bucket.state.codec, "error_feedback", False):
            continue
        carried = [m for m in bucket.members if m.name in slices]
        if not carried:
            continue
        buffer = bucket.buffer()
        residual = torch.zeros(buffer.numel(), dtype=work_dtype(buffer.dtype),
                               device=buffer.device)
        for member in carried:
            first, end = bucket.span(member)
            residual[first:end] = slices[member.name].reshape(-1)
            kept.add(member.name)
        set_residual(bucket.state.codec_state, residual)
    return kept
