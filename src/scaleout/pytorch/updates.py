"""Lazy per-layer updates: when each layer's averaged gradients become its new weights.

:class:`~scaleout.pytorch.DataParallel` owns one :class:`LazyUpdates`; it hands the
gradients out, and :class:`~scaleout.pytorch.DistributedOptimizer` attaches itself as the
:class:`Updater` that applies them. In overlap mode ``step()`` only *requests* the update of
the layers whose gradients are in flight; each is applied at the latest in that layer's next
forward pre-hook (together with the following requested layers whose gradients already
arrived: one optimizer step instead of one per layer). With the sharded update the updater
keeps its owned slices of the weights and of the averaged gradients; the gathered new weights
are written back here, and the updater reads the weights into its slices again at each step
(:mod:`scaleout.pytorch.sharded_update`).

What was done to ``.grad`` between backward and the step that consumes the gradients in flight
(:mod:`scaleout.pytorch.grad_edits`): ``.grad = None`` leaves the parameter out of the step, as
torch does; an edit is refused; ``zero_grad()``
drops them (:meth:`LazyUpdates.discard`). A weight changed in place between ``step()`` and
the update it requested is refused (the update would land on the old values, or overwrite it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from scaleout.pytorch.grad_edits import GradEdits, SentGradients
from scaleout.pytorch.modules import Layer
from scaleout.session import ParameterSet
from scaleout.session.trace import TraceRecorder

__all__ = ["LazyUpdates", "Updater", "averaged", "applied_flags"]


class Updater(Protocol):
    """What applies updates (a DistributedOptimizer)."""

    mode: str

    def apply_update(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor],
                     used: Sequence[bool]) -> None:
        """Update ``params`` alone with their averaged ``grads`` (unused ones are skipped)."""

    def refresh_shards(self) -> None:
        """The model's weights were replaced (a checkpoint loaded): re-read any copies."""

    def receive_gradients(self, layers: Sequence[Layer]) -> None:
        """Sharded update: wait for ``layers``' averaged gradients and keep this rank's owned
        slices of them for the next ``step()`` (the whole averaged gradient exists nowhere)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's ``Optimizer.zero_grad``, over the gradients it consumed and holds too."""


class LazyUpdates(GradEdits):
    """Pending gradients and updates of a DataParallel model's layers.

    Args:
        distributed_update: the update is sharded (the optimizer owns slices).
    """

    def __init__(self, *, distributed_update: bool) -> None:
        self.distributed_update = distributed_update
        self.updater: Updater | None = None
        self.forward_order: list[Layer] = []
        self._position: dict[int, int] = {}
        self._params: list[nn.Parameter] = []
        self._usage: ParameterSet | None = None
        self._globally_used: dict[int, bool] = {}
        self._trace: TraceRecorder | None = None
        self._at_step: dict[int, int] = {}  # a weight's _version when step() requested its update
        self._skipped: set[int] = set()  # ids left out of the requested update (.grad = None)
        self._shares: torch.Tensor | None = None  # the last usage flags: who had a gradient
        #: what left as each parameter's gradient in the last exchange (DataParallel records)
        self.sent = SentGradients()
        self.all_used_here = False  # this rank used every parameter in the last backward
        #: ids of trainable parameters the updater does not hold: they get DDP's semantics
        #: (their averaged gradient in ``.grad`` when backward returns, for another optimizer)
        self.outside: frozenset[int] = frozenset()

    def attach(self, updater: Updater) -> None:
        """Make ``updater`` the one that applies this model's updates.

        Raises:
            ValueError: another updater is attached already.
        """
        if self.updater is not None and self.updater is not updater:
            raise ValueError("this DataParallel already has a DistributedOptimizer")
        self.updater = updater

    @property
    def mode(self) -> str:
        """``"sync"`` without an updater (DDP semantics), else the updater's mode."""
        return "sync" if self.updater is None else self.updater.mode

    def commit(self, forward_order: list[Layer], usage: ParameterSet | None,
               trace: TraceRecorder | None = None) -> None:
        """The layers in forward order, the parameter set carrying who used what, and the
        trace that logs each update."""
        self._trace = trace
        self.forward_order = forward_order
        self._position = {id(layer): i for i, layer in enumerate(forward_order)}
        self._params = [p for layer in forward_order for p in layer.params]
        self._usage = usage

    def pending(self) -> list[Layer]:
        """Layers whose gradients are in flight."""
        return [layer for layer in self.forward_order
                if any(ps.gradient_pending for ps in layer.all_sets())]

    def used_globally(self) -> dict[int, bool]:
        """Whether any rank used each parameter in the last backward (unused: no update).

        When this rank used every parameter the answer is known without reading the
        exchanged flags, so the common case costs no host synchronisation on a GPU (the
        flags decide, on the host, which parameters the optimizer skips).
        """
        if self._usage is not None and self._usage.gradient_pending:
            shares = self._shares = self._usage.wait_gradient_comm()
            if self.all_used_here:
                self._globally_used = {id(p): True for p in self._params}
            else:
                self._globally_used = {id(p): share > 0
                                       for p, share in zip(self._params, shares.tolist())}
        return self._globally_used

    def hold(self, held: Sequence[nn.Parameter], trainable: Sequence[nn.Parameter]) -> None:
        """The updater holds ``held``; the other ``trainable`` parameters are outside it."""
        ids = {id(p) for p in held}
        self.outside = frozenset(id(p) for p in trainable if id(p) not in ids)

    def request(self, layers: Sequence[Layer]) -> None:
        """Apply these layers' updates once their gradients arrive (overlap mode); those
        whose ``.grad`` was set to ``None`` since it left are left out (:meth:`take_edits`)."""
        held = [p for layer in layers for p in layer.params if id(p) not in self.outside]
        self._skipped |= self.take_edits(held)
        for param in held:
            param.grad = None  # the averaged gradient arrives with the update
        self.stepped(held)
        for layer in layers:
            layer.update_requested = True

    def gradients_to_grad(self) -> None:
        """Wait for every gradient and leave the averaged ones in ``.grad`` (DDP-style); with
        the sharded update, their owned slices with the updater, for its next ``step()``.

        Raises:
            RuntimeError: the sharded update without an updater to keep the slices.
        """
        if not self.distributed_update:
            self._to_grad(lambda param: True)
        elif self.updater is None:
            raise RuntimeError("DataParallel(distributed_update=True) needs a "
                               "DistributedOptimizer to apply the sharded update")
        else:
            self.updater.receive_gradients(self.pending())

    def outside_to_grad(self) -> None:
        """Overlap mode, at the end of backward: the averaged gradients of the parameters the
        updater does not hold go to ``.grad`` now, as DDP leaves them, for whatever steps
        them (another optimizer; the updater's own wait in their next forward)."""
        if self.outside:
            self._to_grad(lambda param: id(param) in self.outside)

    def _to_grad(self, which: Callable[[nn.Parameter], bool]) -> None:
        pending = [(param, layer, i) for layer in self.forward_order
                   for i, (param, ps) in enumerate(zip(layer.params, layer.sets))
                   if ps.gradient_pending and which(param)]
        dropped = self.take_edits([p for p, _, _ in pending if id(p) not in self.outside])
        arrived = [averaged(layer, i) for _, layer, i in pending]
        used = self.used_globally()  # after the gradients: waits count against their layers
        applied = applied_flags([param for param, _, _ in pending], arrived, used)
        for (param, _, _), averaged_grad, flag in zip(pending, arrived, applied):
            if not flag or id(param) in dropped:
                param.grad = None
            elif param.grad is None:
                param.grad = averaged_grad.view_as(param).clone()
            else:
                param.grad.copy_(averaged_grad.view_as(param))

    def complete(self, layer: Layer) -> None:
        """Apply ``layer``'s requested update and install its gathered shards, if pending."""
        if layer.update_requested:
            self._apply(layer)
        if layer.increments_pending:
            self._refuse_changed(layer.params)
            layer.increments_pending = False
            with torch.no_grad():
                for param, ps in zip(layer.params, layer.sets):
                    param.copy_(ps.wait_increment_comm().view_as(param))

    def apply_requested(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Apply every requested update now (``step()`` again before the next forward); each
        parameter updated, with the averaged gradient applied (valid until the next backward)."""
        applied: list[tuple[nn.Parameter, torch.Tensor]] = []
        for layer in self.forward_order:
            if layer.update_requested:
                applied += self._apply(layer)
        return applied

    def synchronize(self) -> None:
        """Finish every pending update; gradients nobody asked to apply go to ``.grad`` (with
        the sharded update, to the updater's slices)."""
        for layer in self.forward_order:
            self.complete(layer)
        if self.pending():
            self.gradients_to_grad()

    def _arrived_after(self, layer: Layer) -> list[Layer]:
        """The requested layers right after ``layer`` whose gradients already arrived.

        Updating them with ``layer`` costs one optimizer step (which walks every parameter)
        instead of one per layer; the values are the same, only applied earlier.
        """
        batch = []
        for later in self.forward_order[self._position[id(layer)] + 1:]:
            if not later.update_requested:
                continue
            if not all(ps.test_gradient_comm() for ps in later.all_sets()
                       if ps.gradient_pending):  # (not pending: an outside one, delivered)
                break
            batch.append(later)
        return batch

    def _apply(self, layer: Layer) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Wait for ``layer``'s averaged gradients and apply its update in one step with the
        layers after it whose gradients arrived meanwhile (looked for after the wait, so one
        wait for a bucket of many layers is followed by one step for all of them); each
        parameter updated, with its averaged gradient."""
        assert self.updater is not None, "updates are requested by an attached optimizer"
        params: list[nn.Parameter] = []
        grads: list[torch.Tensor] = []
        layers = [layer]

        def take(one: Layer) -> None:
            one.update_requested = False
            for i, param in enumerate(one.params):
                if id(param) not in self.outside:  # (delivered to .grad in backward)
                    params.append(param)
                    grads.append(averaged(one, i))

        take(layer)
        for later in self._arrived_after(layer):
            take(later)
            layers.append(later)
        if not params:
            return []
        self._refuse_changed(params)
        used = self.used_globally()  # after the gradients: waits count against their layers
        flags = applied_flags(params, grads, used)
        if self._skipped:  # (.grad = None between backward and step: left out, as in torch)
            flags = [flag and id(p) not in self._skipped for p, flag in zip(params, flags)]
            self._skipped.difference_update(id(p) for p in params)
        began = time.perf_counter()
        self.updater.apply_update(params, grads, flags)
        if self._trace is not None:
            self._trace.span("compute", "update " + "+".join(l.name for l in layers), began,
                             time.perf_counter(), phase="update")
        return list(zip(params, grads))


def applied_flags(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor],
                  used: dict[int, bool]) -> list[bool]:
    """Whether each parameter's averaged gradient is applied: a parameter some rank used,
    and one no rank used whose average is not zero all the same (a codec delivering part of
    its error-feedback residual: skipping it would lose that gradient for good; with exact
    gradients an unused parameter's average is zero and it is skipped, as torch skips a
    parameter without ``.grad``). One host read for the unused ones, where the used flags
    were read on the host already."""
    flags = [used.get(id(p), True) for p in params]
    idle = [i for i, flag in enumerate(flags) if not flag]
    if idle:
        nonzero = torch.stack([grads[i].ne(0).any() for i in idle]).tolist()
        for i, value in zip(idle, nonzero):
            flags[i] = bool(value)
    return flags


def averaged(layer: Layer, index: int) -> torch.Tensor:
    """Wait for ``layer``'s parameter ``index``'s averaged gradient: its set's, plus its early
    share's when it travels in two (a tied parameter: ``scaleout.pytorch.tied``), plus what a
    replaced plan still owed it (``layer.carry``, once)."""
    gradient = layer.sets[index].wait_gradient_comm()
    early = layer.early.get(index)
    if early is not None:
        gradient = gradient + early.wait_gradient_comm()
    owed = layer.carry.pop(index, None) if layer.carry else None  # (a replaced plan's residual)
    return gradient if owed is None else gradient + owed.view_as(gradient)
