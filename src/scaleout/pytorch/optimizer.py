"""DistributedOptimizer: step() returns at once; each layer is updated when its gradients land."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from scaleout.compression.advice import warn_unsuited
from scaleout.core.grid import GroupType
from scaleout.pytorch.clipping import clip_global_norm
from scaleout.pytorch.data_parallel import DataParallel
from scaleout.pytorch.modules import Layer
from scaleout.pytorch.outside_steps import watch_outside_steps
from scaleout.pytorch.sharded_update import ShardedUpdate, group_options

__all__ = ["DistributedOptimizer", "MODES", "optimizer_state_bytes"]

MODES = ("overlap", "sync")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors held in ``optimizer.state`` (momentum, Adam moments, ...)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _check_params(model: DataParallel, params: Any) -> None:
    trained = {id(p) for layer in model.layers for p in layer.params}
    for param in [params] if isinstance(params, torch.Tensor) else params:
        # (an empty parameter has nothing to exchange: DataParallel leaves it out)
        if param.requires_grad and param.numel() and id(param) not in trained:
            raise ValueError("the optimizer holds a parameter that is not a trainable "
                             "parameter of the DataParallel model")


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS: it evaluates the loss itself,
    several times a step)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # (no signature to read: a step built in C)
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer for a :class:`DataParallel` model.

    Args:
        optimizer: any torch optimizer over the model's parameters (SGD, Adam, AdamW, ...;
            one whose ``step()`` needs a closure, LBFGS, in ``mode="sync"`` only).
            Learning-rate schedulers may be attached to this object (or to ``optimizer``: with
            the sharded update, the options its groups change reach the step that follows).
        model: the DataParallel model.
        mode: ``"overlap"`` — ``step()`` returns at once and each layer's update is applied
            when its gradient communication completes, at the latest in that layer's forward
            pre-hook of the next iteration (``.grad`` is consumed: it is ``None`` after
            ``step()``; a second ``step()`` before that forward applies the first one's
            update, and its gradients again unless ``zero_grad()`` ran, as torch does);
            ``"sync"`` — like DDP, averaged gradients are in ``.grad`` when ``backward()``
            returns and ``step()`` updates everything (a closure goes to ``optimizer``,
            which may run it several times: LBFGS; let it return the same loss on every
            rank, the average, where ``optimizer`` decides by the loss). Trainable parameters
            that ``optimizer`` does not hold get DDP's ``.grad`` in both modes (for another
            optimizer: docs/scheduling.md).
        max_grad_norm: clip the averaged gradients to this global norm (over every layer)
            before the update, like ``clip_grad_norm_`` after DDP's backward; in overlap mode
            that step then waits for all gradients (the norm needs them all); with the
            sharded update, the owned slices by the whole gradient's norm (one scalar
            all-reduce per step). Clipping ``.grad`` yourself works in sync mode without the
            sharded update only (in overlap mode the gradients have left: scaleout warns once
            if ``.grad`` changes after it was sent; with the sharded update ``.grad`` is this
            rank's own gradient, not the average: an edit is refused).

    Between ``backward()`` and ``step()``, as in torch: ``zero_grad()`` drops that backward's
    gradients (the step then steps without them, the next backward starts afresh), and
    ``p.grad = None`` leaves ``p`` out of the step (refused where some rank did not use ``p``:
    it has no ``.grad`` to drop; since stop 49: both were ignored in overlap mode and with the
    sharded update).

    Overlap mode updates the weights in the next forward: a weight read right after
    ``step()`` still holds its old values (an EMA of it lags a step), and one changed in place
    before the update that ``step()`` requested has landed (a WGAN's clamp, loading into the
    bare module) is refused with a ``RuntimeError`` when the update lands (since stop 49;
    before, the change was lost or the update landed on it): call ``model.synchronize()``
    after ``step()`` first, or use ``mode="sync"``. Change weights through the parameter
    under ``torch.no_grad()``, not ``p.data``: its own version counter hides the change from
    that check (after ``model.synchronize()`` either way works).

    With ``DataParallel(distributed_update=True)`` the update is sharded: this rank keeps
    optimizer state only for its owned slice of every parameter (about 1/N of it), updates
    that slice, and the new values are all-gathered while the next forward runs
    (:mod:`scaleout.pytorch.sharded_update`). The averaged gradients exist only as those
    slices (a weight's ``.grad`` is ``None`` once ``step()`` or a synchronisation took it),
    and ``optimizer`` must be one of torch's elementwise optimizers
    (``sharded_update.ELEMENTWISE``). Each ``step()`` reads this rank's slice of every weight
    into its shard (since stop 51; before, only weights whose ``_version`` had moved, and a
    change through ``p.data`` was lost): weights changed after their new values landed (after
    ``model.synchronize()`` in overlap mode; any time between steps in sync mode), in any way,
    are what the step starts from. ``GradScaler`` is refused with it, as in overlap mode.
    ``optimizer`` itself never steps and holds no state: save and load this object's
    ``state_dict()`` (``optimizer``'s raise a ``ValueError``, since stop 51).

    Raises:
        ValueError: an optimizer whose ``step()`` needs a closure outside ``mode="sync"`` or
            with the sharded update; the sharded update with an optimizer that is not
            elementwise; a ``GradScaler`` step in overlap mode or with the sharded update.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallel, *,
                 mode: str = "overlap", max_grad_norm: float | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, DataParallel):
            raise TypeError(f"model must be a scaleout DataParallel, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
                    or not math.isfinite(max_grad_norm) or max_grad_norm <= 0:
                raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got "
                                 f"{max_grad_norm!r}")
        if needs_closure(optimizer) and (mode != "sync" or model.distributed_update):
            raise ValueError(
                f"{type(optimizer).__name__}.step() needs a closure (it evaluates the loss and "
                f"gradients itself, several times a step): wrap it with "
                f"DistributedOptimizer(..., mode='sync') on a DataParallel without "
                f"distributed_update; got mode={mode!r}, distributed_update="
                f"{model.distributed_update} (overlap mode applies each update after step() "
                f"returns, and the sharded update steps slices of the weights)")
        for group in optimizer.param_groups:
            _check_params(model, group["params"])
        if model.compression is not None:  # codecs measured not to converge with it: say so now
            warn_unsuited(model.compression, optimizer)
        self.mode = mode
        self.max_grad_norm = max_grad_norm
        self.model = model
        self.sharded = model.distributed_update
        self._user_optimizer = optimizer
        self._sharded_update = (ShardedUpdate(optimizer, model, max_grad_norm) if self.sharded
                                else None)
        self.inner = optimizer if self._sharded_update is None else self._sharded_update.optimizer
        super().__init__([torch.zeros(1, requires_grad=True)], {})
        self.param_groups = self.inner.param_groups  # schedulers edit the real groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults
        self._snapshot: list[dict[str, Any]] = []
        # the weights whose .grad step() took (overlap mode, the sharded update), by id
        self._consumed: dict[int, nn.Parameter] = {}
        self._wrapping = True  # (add_param_group adds to the wrapped optimizer from now on)
        model.updates.attach(self)
        self._hold()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The groups in effect (the wrapped optimizer's; with the sharded update, its copy's,
        after taking in what a scheduler attached to the wrapped optimizer changed since the
        last step: since stop 52; before, they showed the last step's options, an lr logged
        from them one step behind, 0.39 off under OneCycleLR)."""
        sharded = self.__dict__.get("_sharded_update")
        if sharded is not None:
            sharded.follow_user_groups()
        return self.__dict__["param_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.__dict__["param_groups"] = groups

    def _held(self) -> list[nn.Parameter]:
        """The model's parameters this optimizer steps (the wrapped optimizer's groups)."""
        return [p for group in self._user_optimizer.param_groups for p in group["params"]]

    def _hold(self) -> None:
        """Tell the model which of its trainable parameters are outside this optimizer: they
        keep torch's semantics (``.grad`` averaged when backward returns, accumulating until
        something zeroes it). With the sharded update their gradient exists only in slices,
        so another optimizer stepping one is refused (``outside_steps``)."""
        trainable = [p for layer in self.model.layers for p in layer.params]
        self.model.updates.hold(self._held(), trainable)
        if self.sharded and self.model.updates.outside:
            watch_outside_steps(self)

    def parameter_shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's full shape, in the order of this optimizer's state indices (with
        the sharded update, the state holds slices of these: see ``pytorch.resharding``)."""
        return [tuple(p.shape) for g in self._user_optimizer.param_groups for p in g["params"]]

    def refresh_shards(self) -> None:
        """Copy the model's current weights into the owned shards (after loading weights)."""
        if self._sharded_update is not None:
            self._sharded_update.read(self._held())

    def receive_gradients(self, layers: Sequence[Layer]) -> None:
        """Sharded update: keep ``layers``' averaged gradients (owned slices) for ``step()``."""
        assert self._sharded_update is not None, "only the sharded update hands gradients over"
        self._consumed.update((id(p), p) for p in self._sharded_update.receive(layers))

    # -- the torch.optim.Optimizer surface ------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Request this iteration's update (applied lazily in overlap mode)."""
        self._refuse_grad_scaler()
        # a scheduler attached to the wrapped optimizer sees its step (torch's flag: it warns
        # "lr_scheduler.step() before optimizer.step()" otherwise), stepped later or never
        self._user_optimizer._opt_called = True  # type: ignore[attr-defined]
        if self.mode == "sync" and self._sharded_update is None:
            return self._sync_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._sharded_update is not None:
            taken = self._sharded_update.step(self.model.updates.pending(),
                                                 consume=self.mode == "overlap")
            self._consumed.update((id(p), p) for p in taken)
            if self.mode == "sync":
                self.model.synchronize()
            return loss
        self._apply_requested()
        pending = self.model.updates.pending()
        if self.max_grad_norm is not None:  # (it waits for every gradient: the norm needs all)
            self._clip()
            self.inner.step()
        elif not pending:
            self.inner.step()
        else:
            self._snapshot = group_options(self.inner)  # (a tensor lr changes in place)
            outside = self.model.updates.outside
            self._consumed = {id(p): p for layer in pending for p in layer.params
                              if p.grad is not None and id(p) not in outside}
            self.model.updates.request(pending)
        return loss

    def _sync_step(self, closure: Callable[[], Any] | None) -> Any:
        """torch's step over the averaged ``.grad`` that backward left; a closure goes to the
        wrapped optimizer, which may call it several times (LBFGS), each call's gradients
        clipped when asked."""
        if closure is None:
            if self.max_grad_norm is not None:
                self._clip()
            return self.inner.step()

        @torch.enable_grad()
        def evaluate() -> Any:
            loss = closure()
            if self.max_grad_norm is not None:
                self._clip()
            return loss
        return self.inner.step(evaluate)

    def _clip(self) -> None:
        """Clip the averaged gradients to ``max_grad_norm`` (waiting for all of them)."""
        if self.model.updates.pending():
            self.model.updates.gradients_to_grad()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        clip_global_norm(params, self.max_grad_norm,  # type: ignore[arg-type]
                         self.model.distribution.communicator(GroupType.MODEL))

    def _apply_requested(self) -> None:
        """Overlap mode, ``step()`` again before the next forward (no backward since, or
        ``step(); step()``): the update the last one requested is applied first, and its
        averaged gradients are back in ``.grad`` unless ``zero_grad()`` ran since, as torch
        leaves them after a step. Nothing to do in the usual loop."""
        for param, grad in self.model.updates.apply_requested():
            if id(param) in self._consumed and param.grad is None:
                param.grad = grad.view_as(param).clone()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, after the pending updates (requested with the groups as they were).

        Raises:
            ValueError: with ``distributed_update=True`` (the shards are made at construction),
                or a parameter that the model does not train.
        """
        if not self.__dict__.get("_wrapping", False):  # Optimizer.__init__'s placeholder
            super().add_param_group(param_group)
            return
        if self.sharded:
            raise ValueError("add_param_group with DataParallel(distributed_update=True) is not "
                             "supported: give every group to the optimizer before wrapping it")
        _check_params(self.model, param_group.get("params", []))
        self.model.synchronize()
        self.inner.add_param_group(param_group)
        self._hold()
        if self.model.compression is not None:  # the new group's options against the codecs
            warn_unsuited(self.model.compression, self.inner)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True in overlap mode and with the sharded update, so that a ``GradScaler`` hands
        ``step()`` its scale (and ``step()`` refuses it: see :meth:`_refuse_grad_scaler`);
        sync mode without it takes torch's path."""
        return self.mode == "overlap" or self.sharded

    def _refuse_grad_scaler(self) -> None:
        if hasattr(self, "grad_scale") or hasattr(self, "found_inf"):
            raise ValueError(
                "GradScaler needs DistributedOptimizer(..., mode='sync') on a DataParallel "
                f"without distributed_update; got mode={self.mode!r}, distributed_update="
                f"{self.sharded}: in overlap mode each scaled gradient has left before the "
                "scaler can unscale it or look for infs, and with the sharded update each rank "
                "holds only its slices of the averaged gradients, so every rank would decide on "
                "its own gradients whether to skip the step (the replicas part, or the job hangs)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: this optimizer's parameters only (and their shards' gradients, with
        the sharded update). With ``set_to_none=False`` in overlap mode or with the sharded
        update, the gradients ``step()`` consumed come back as zeros, as a plain optimizer
        leaves them: a parameter no rank uses next still has a (zero) gradient, so momentum
        and weight decay move it. Between backward and step (in overlap mode or with the
        sharded update, where that backward's gradients are still in flight) it drops them,
        as torch discards them: it waits for their exchange, the next ``step()`` steps
        without them and the next backward starts afresh."""
        self.model.updates.discard()
        for param in self._held():
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
        if not set_to_none:
            for param in self._consumed.values():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        self._consumed = {}
        if self._sharded_update is not None:
            self._sharded_update.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, after finishing pending updates (with the sharded
        update, with the options a scheduler attached to the wrapped optimizer set since the
        last step, and of this rank's slices alone, labelled with its rank and the world size:
        every rank saves its own, as ``scaleout.checkpoint.save`` does; since stop 52,
        ``load_state_dict`` refuses another rank's: ``ShardedUpdate.unlabelled``)."""
        self.model.synchronize()
        if self._sharded_update is None:
            return self.inner.state_dict()
        self._sharded_update.follow_user_groups()
        return self._sharded_update.labelled(self.inner.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's: the state and the groups' options are the loaded ones (with the
        sharded update, the wrapped optimizer's groups show them too)."""
        self.model.synchronize()
        if self._sharded_update is not None:  # (another rank's slices: a ValueError)
            state_dict = self._sharded_update.unlabelled(state_dict)
        self.inner.load_state_dict(state_dict)
        if self._sharded_update is not None:
            self._sharded_update.show_options()
        # torch replaces the groups and the state: a scheduler edits them through this wrapper
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    # -- updates -------------------------------------------------------------------------

    def apply_update(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor],
                     used: Sequence[bool]) -> None:
        """Update ``params`` alone with their averaged ``grads`` and this iteration's options."""
        saved = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for group, options in zip(self.param_groups, self._snapshot):
            group.update(options)
        held = [param.grad for param in params]  # (zeros from zero_grad(set_to_none=False))
        # the others' .grad (zeros from zero_grad(set_to_none=False)) would step them too:
        # their updates are other batches' (momentum would move them once more per batch)
        chosen = {id(param) for param in params}
        others = [(p, p.grad) for group in self.inner.param_groups for p in group["params"]
                  if p.grad is not None and id(p) not in chosen]
        try:
            for param, _ in others:
                param.grad = None
            for param, grad, flag in zip(params, grads, used):
                param.grad = grad.view_as(param) if flag else None
            self.inner.step()  # parameters without .grad are skipped by torch optimizers
        finally:
            for param, grad in (*zip(params, held), *others):
                param.grad = grad
            for group, options in zip(self.param_groups, saved):
                group.update(options)
