"""What was done to ``.grad`` between backward and step, told from what left.

In overlap mode and with the sharded update a gradient leaves for the average the moment
backward produces it, and ``.grad`` keeps this rank's own gradient: the update steps the
average that arrives, not ``.grad``. To keep torch's semantics where they can be kept,
:class:`SentGradients` remembers which ``.grad`` tensor left and its version, so that when
the gradients in flight are consumed (``step()``, ``model.synchronize()``) a parameter whose
``.grad`` was set to ``None`` (torch's optimizers skip it: the step leaves it out) is told
apart from one whose ``.grad`` was changed in place or replaced (clipped by hand: the change
cannot reach the average: refused). A weakref and a
version per gradient sent, one lookup and one version read per parameter per step.

``zero_grad()`` between backward and step drops the gradients in flight
(:meth:`GradEdits.discard`); a backward that finds gradients still in flight, every one of
them dropped by hand since (a module's ``zero_grad()``), drops them too and starts afresh.
:class:`GradEdits`, a mixin of :class:`~scaleout.pytorch.updates.LazyUpdates`, holds these
checks, and the refusal of a weight changed in place between ``step()`` and the update it
requested landing (overlap mode: a WGAN's clamp before ``model.synchronize()``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["GradEdits", "SentGradients", "edited_message", "partial_skip_message",
           "changed_weights_message"]


class SentGradients:
    """Each parameter's ``.grad`` as it left in the last exchange (none: zeros left for it)."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}

    def record(self, param: nn.Parameter, grad: torch.Tensor | None) -> None:
        """``grad`` left as ``param``'s gradient (``None``: zeros left, it had none)."""
        if grad is None:
            self._sent.pop(id(param), None)
        else:
            self._sent[id(param)] = (grad._version, weakref.ref(grad))

    def edits(self, params: Sequence[nn.Parameter]) -> tuple[list[nn.Parameter],
                                                             list[nn.Parameter]]:
        """``params`` whose ``.grad`` was set to ``None`` since it left (dropped), and those
        whose ``.grad`` was changed in place or replaced (a ``.grad`` where none left too)."""
        dropped: list[nn.Parameter] = []
        edited: list[nn.Parameter] = []
        for param in params:
            sent = self._sent.get(id(param))
            grad = param.grad
            if grad is None:
                if sent is not None:
                    dropped.append(param)
            elif sent is None or sent[1]() is not grad or grad._version != sent[0]:
                edited.append(param)
        return dropped, edited

    def all_dropped(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether some of ``params`` left with a ``.grad`` and every such ``.grad`` is gone
        now (``None``, or another tensor: one that a new backward accumulated afresh)."""
        sent = [(param, self._sent[id(param)]) for param in params if id(param) in self._sent]
        return bool(sent) and all(param.grad is None or param.grad is not ref()
                                  for param, (_, ref) in sent)


class GradEdits:
    """The checks of :class:`~scaleout.pytorch.updates.LazyUpdates` on what was done to
    ``.grad`` and to the weights around a step (a mixin: it uses the updates' ``sent``,
    ``mode``, ``distributed_update``, ``outside``, ``forward_order``, ``pending()``,
    ``used_globally()`` and the usage flags they keep)."""

    sent: SentGradients
    mode: str
    distributed_update: bool
    outside: frozenset[int]
    forward_order: list[Any]
    _params: list[nn.Parameter]
    _usage: Any
    _shares: torch.Tensor | None
    _at_step: dict[int, int]

    def take_edits(self, params: Sequence[nn.Parameter]) -> set[int]:
        """Before ``params``' gradients in flight are consumed: what was done to their
        ``.grad`` since it left. The ids of those set to ``None`` (left out of this step, as
        torch leaves them; refused where some rank had no gradient to drop); one changed in
        place or replaced is refused (``.grad`` is not what is stepped: the average left with
        the gradient; overlap mode warned once before stop 49, and stepped without the change).

        Raises:
            RuntimeError: an edit of ``.grad``; ``.grad = None`` on a parameter that some
                rank did not use.
        """
        if self.mode == "sync" and not self.distributed_update:  # (.grad is what it steps)
            return set()
        dropped, edited = self.sent.edits(params)
        if edited:
            raise RuntimeError(edited_message(self._names(edited), self.distributed_update))
        if dropped:
            self._refuse_partial_skip(dropped)
        return {id(p) for p in dropped}

    def _refuse_partial_skip(self, dropped: Sequence[nn.Parameter]) -> None:
        """Leaving a parameter out is agreed only where every rank had a gradient of it to
        drop (a rank without one cannot see it): the usage flags say (read on the host)."""
        self.used_globally()
        if self._shares is None:
            return
        shares = self._shares.tolist()
        index = {id(p): i for i, p in enumerate(self._params)}
        partial = [p for p in dropped if shares[index[id(p)]] < 1.0 - 1e-6]
        if partial:
            raise RuntimeError(partial_skip_message(self._rank(), self._names(partial)))

    def stepped(self, params: Sequence[nn.Parameter]) -> None:
        """``step()`` requested ``params``' update (or started gathering their new values)."""
        for param in params:
            self._at_step[id(param)] = param._version

    def _refuse_changed(self, params: Sequence[nn.Parameter]) -> None:
        """Raises RuntimeError for weights changed in place since :meth:`stepped`."""
        changed = [p for p in params if p._version != self._at_step.get(id(p), p._version)]
        if changed:
            raise RuntimeError(changed_weights_message(self._names(changed)))

    def discard(self) -> None:
        """Drop the gradients in flight that no ``step()`` asked to apply (``zero_grad()``
        between backward and step, as torch's discards that backward's): wait for them
        (their exchange completes on every rank) and forget them; the next backward starts
        afresh. What a replaced plan still owes (``layer.carry``) stays for the next one."""
        dropped = [layer for layer in self.pending() if not layer.update_requested]
        for layer in dropped:
            for ps in layer.all_sets():
                if ps.gradient_pending:
                    ps.wait_gradient_comm()
        if dropped:
            self.used_globally()  # (that backward's usage flags)

    def discarded_by_hand(self, reached: nn.Parameter | None = None) -> bool:
        """A backward found gradients still in flight that no ``step()`` asked for: when
        every ``.grad`` that left with them is gone since (a module's ``zero_grad()``, or
        ``.grad = None`` for each), they are dropped (:meth:`discard`) and True returned.
        ``reached``: the parameter whose new gradient found them (its ``.grad`` is this
        backward's: a new tensor also where ``create_graph=True`` accumulates out of place,
        so the others decide)."""
        layers = [layer for layer in self.pending() if not layer.update_requested]
        held = [p for layer in layers for p in layer.params
                if id(p) not in self.outside and p is not reached]
        if not layers or not self.sent.all_dropped(held):
            return False
        self.discard()
        return True

    def _names(self, params: Sequence[nn.Parameter]) -> list[str]:
        names = {id(p): ps.name for layer in self.forward_order
                 for p, ps in zip(layer.params, layer.sets)}
        return [names.get(id(p), "a parameter") for p in params]

    def _rank(self) -> int:
        return -1 if self._usage is None else self._usage.distribution.env.rank


def _named(names: Sequence[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{names[0]}{more}"


def edited_message(names: Sequence[str], sharded: bool) -> str:
    """Why an edit of ``.grad`` after it left does not reach the update."""
    if not sharded:
        return (f"the .grad of {_named(names)} was changed in place or replaced after its "
                "communication started: in overlap mode the gradient left for the average as "
                "backward produced it, and the update steps that average, so the change cannot "
                "reach it. Clip with DistributedOptimizer(..., max_grad_norm=...), or use "
                "mode='sync' (the average is in .grad when backward returns, as with DDP)")
    return (f"the .grad of {_named(names)} was changed in place or replaced between backward() "
            "and the step that consumes it: with DataParallel(distributed_update=True) .grad "
            "holds this rank's own gradient, not the average (each rank receives only its "
            "owned slice of that), so the change cannot reach the update. Clip with "
            "DistributedOptimizer(..., max_grad_norm=...); leave a parameter out of one step "
            "with .grad = None; drop a backward's gradients with the optimizer's zero_grad()")


def partial_skip_message(rank: int, names: Sequence[str]) -> str:
    """Why ``.grad = None`` on a parameter that some rank did not use is refused."""
    return (f"rank {rank}: the .grad of {_named(names)} was set to None between backward() "
            "and step(), which leaves it out of this step, but some rank had no gradient of it "
            "(it did not use it), so that rank cannot see the change and would apply the "
            "averaged gradient: the replicas would part. Freeze it with requires_grad_(False) "
            "before the forward, or use DistributedOptimizer(..., mode='sync') without "
            "distributed_update")


def changed_weights_message(names: Sequence[str]) -> str:
    """Why a weight changed in place between ``step()`` and its pending update is refused."""
    return (f"{_named(names)} was changed in place after optimizer.step() and before the update "
            "that step requested was applied: in overlap mode step() returns at once and each "
            "layer's update lands in its next forward (with the sharded update, the gathered "
            "new values are written over the weight), so the change would be applied to the "
            "old weights or lost. Call model.synchronize() after step() before changing (or "
            "reading) weights, or use DistributedOptimizer(..., mode='sync')")
