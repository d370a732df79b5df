"""DataParallel's backward side: each gradient leaves the moment it exists (through a comm
hook, when one is registered), and the end of backward sends what did not (a parameter's
``.grad`` or zeros for parameters unused here, a tied parameter's early share that no hook
took) and the flags saying who has a gradient; that end ends a training iteration of the
statistics (and the trace): a forward without backward (evaluation) or a ``no_sync()``
micro-batch's backward does not.

A mixin of :class:`~scaleout.pytorch.DataParallel` (it uses the model's ``module``,
``_session``, ``_alone``, ``_compression``, ``_tuner``, ``_comm_hook``, ``_set_of``,
``_forward_order``, ``_used``, ``_no_sync``, ``_shares``, ``_stopwatch``, ``_lookup_rows``,
``updates``, ``replicas``, ``distributed_update`` and ``env``). What left as each gradient
is recorded in ``updates.sent``, for what ``step()`` finds done to ``.grad`` after
(:mod:`scaleout.pytorch.grad_edits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from scaleout.pytorch.dp_lifetime import weak_method, weakly
from scaleout.session.bucket import CommHook

__all__ = ["BackwardSide"]


class BackwardSide:
    """The autograd-side callbacks of DataParallel (see the module docstring)."""

    #: a gradient of the running backward was handed to the exchange (since stop 52: set
    #: apart from ``_backward_queued``, which a gradient refused before it left sets too)
    _gradient_sent = False

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Send gradient buckets with ``hook(state, bucket)`` (DDP's comm-hook contract).

        ``bucket`` is a :class:`~scaleout.session.GradBucket` (``buffer()``, ``index()``,
        ``gradients()``, ``parameters()``, ``is_last()``); the hook returns a scaleout
        Request or a ``torch.futures.Future`` whose result is the flat gradient averaged
        over the data group. torch's own hooks run unchanged, e.g.
        ``model.register_comm_hook(None, default_hooks.fp16_compress_hook)``.

        ``state=None`` reaches the hook as the lane's own process group over the data group
        (since stop 52; torch's hooks read None as the default group: the model group's
        ranks too on a grid). In overlap mode the hook may still be called on the progress
        thread after ``backward()`` and ``step()`` return: a hook given a group that your
        own collectives use too (``dist.group.WORLD``: a loss all-reduce) needs
        ``model.synchronize()`` before them, or the two may meet the group in a different
        order on each rank and wait out the timeout (``checkpoint.save`` / ``load``
        synchronize first since stop 52).

        Raises:
            RuntimeError: after the first forward, or with ``compression=`` (one or the other).
        """
        if self._session is not None or self._alone is not None:
            raise RuntimeError("register_comm_hook must be called before the first forward")
        if self._compression is not None or self._tuner is not None:
            raise RuntimeError("register_comm_hook replaces compression= and tune=: pass one "
                               "or the other")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._comm_hook = (state, hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``, and with a DistributedOptimizer as its ``zero_grad()``
        too (first), which zeroes what ``.grad`` no longer shows (since stop 51): the
        gradients an overlap-mode ``step()`` consumed (``set_to_none=False`` gives them zeros
        again, as torch leaves them; they stayed ``None``, and a parameter no rank used next
        did not move by momentum and weight decay: 0.031 off), the sharded update's averaged
        slices (they accumulated over the steps: 0.35 off in sync mode), and between
        backward and step, that backward's gradients in flight."""
        if self.updates.updater is not None:
            self.updates.updater.zero_grad(set_to_none)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def _on_grad(self, param: nn.Parameter) -> None:
        self._used[id(param)] = True
        if self._no_sync:
            return
        if self._session is None:
            raise RuntimeError("backward ran through DataParallel before its first forward")
        self._on_share(param)
        layer, ps = self._set_of[id(param)]
        self._stopwatch.lap(self._session.statistics, layer.name, phase="backward")
        if self._lookup_rows:  # (whether only its lookups wrote the gradient the hint is of)
            self._lookup_rows.settle(param)
        self._sender(ps)(param.grad, param)
        self.updates.sent.record(param, param.grad)

    def _on_share(self, param: nn.Parameter) -> None:
        """A gradient (or a tied parameter's early share) of ``param`` left: it was used, and
        the end of this backward sends what did not (at the end of the graph task that
        reached the model's output, when one did: :meth:`_watch_output`)."""
        self._used[id(param)] = True
        if not self._backward_queued:
            self._backward_queued = True
            if not self._outer_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _refuse_broken_backward(self) -> None:
        """Before a forward (not one autograd reruns inside a backward): the last backward
        must have ended. One stopped by an exception (in a hook, out of memory) never runs
        its end: with no gradient sent yet, it is as if it never ran; once gradients have
        left for the other ranks, the exchange can be neither finished nor taken back (since
        stop 52: the flags stayed set, so no later backward ended and this rank trained on
        without exchanging a gradient while the others waited, or paired its next
        gradients with the others' last). Only a gradient handed to the exchange counts:
        one refused before it left ("produced again" at the first gradient) refused the next
        forward too, saying gradients had left (since stop 52)."""
        if torch._C._current_graph_task_id() != -1:
            return
        if self._gradient_sent:
            raise RuntimeError(
                f"rank {self.env.rank}: the last backward through DataParallel stopped part-way "
                "(an exception raised inside backward: a hook's, a failed allocation), after "
                "some of its gradients had left for the other ranks: that exchange can be neither "
                "finished nor undone, so this model cannot train on. Let the error end the "
                "job (the other ranks then name this one) and resume from a checkpoint; to "
                "skip a batch, decide before backward() on every rank alike")
        # (no gradient left: nothing to undo; its end, queued or not, is forgotten)
        self._backward_queued = self._outer_queued = False

    def _watch_output(self, output: Any) -> None:
        """After a training forward: hook the output's tensors (and the tied parameters'
        readers), so that the backward that reaches them ends the model's backward.

        A callback queued from a gradient's hook runs when that hook's graph task ends, and
        a reentrant activation checkpoint (``checkpoint(..., use_reentrant=True)``) runs
        its block's backward as a graph task nested in the outer one: the end came before
        the layers in front of the block had their gradients (they went as unused zeros,
        then again; a codec's exchange ran twice: blockquant 2.4e-3 off, overlap mode
        failed). The output's hook runs in the outer task, at the model's backward's start.
        """
        if self._shares:
            self._shares.hook(output)
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(weak_method(self._on_output_grad))  # (a kept loss)

    def _on_output_grad(self, _grad: torch.Tensor) -> None:
        if not self._outer_queued:
            self._outer_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_outer)

    def _end_outer(self) -> None:
        """The graph task that reached the output ended: the model's backward ended, if a
        gradient arrived in it (``torch.autograd.grad`` of the output, a gradient penalty's,
        accumulates none: nothing is sent)."""
        self._outer_queued = False
        if self._backward_queued:
            self._end_backward()

    def _sender(self, ps: Any) -> Callable[..., None]:
        def send(model: Any, gradient: torch.Tensor, param: nn.Parameter | None = None) -> None:
            # (the last backward's, each .grad of it dropped by hand since: dropped, as torch;
            # ``param``'s own .grad is this backward's already, told apart by the others)
            if ps.gradient_pending and not model.updates.discarded_by_hand(param):
                # (sync mode accumulates, but not the sharded update: only its slices exist)
                other = "" if model.updates.mode == "sync" else \
                    ", or use DistributedOptimizer(..., mode='sync')"
                raise RuntimeError(
                    f"rank {model.env.rank}: gradient of {ps.name} produced again while the last "
                    "one is still on its way to the update (two backward passes without "
                    "optimizer.step() between them?); to accumulate micro-batches, run all but "
                    f"the last in model.no_sync(){other}; to drop the last backward's "
                    "gradients, call the DistributedOptimizer's zero_grad() before this "
                    "backward")
            model._gradient_sent = True  # (before: a hook raising inside may have sent)
            ps.start_gradient_comm(gradient)
        return weakly(self, send)  # (tied parameters' early shares hook the graph)

    def _send_unused(self, param: nn.Parameter, ps: Any) -> None:
        """A parameter this backward did not reach: its ``.grad`` if it holds one (gradients
        accumulated in ``no_sync()`` micro-batches, zeros left by ``zero_grad(set_to_none=
        False)``), as DDP sends an unused parameter's defined gradient; else zeros."""
        grad = param.grad
        ps.start_gradient_comm(self._zeros(ps) if grad is None else grad)
        self.updates.sent.record(param, grad)

    @staticmethod
    def _zeros(ps: Any) -> torch.Tensor:
        return torch.zeros(ps.local_count, dtype=ps.spec.dtype, device=ps.spec.device)

    def _end_backward(self) -> None:
        self._backward_queued = self._gradient_sent = False
        self.replicas.exchanged()
        if self._shares:
            self._shares.end_backward()
        used = []
        for layer in self._forward_order:
            for param, ps in zip(layer.params, layer.sets):
                if not ps.gradient_pending:  # unused in this backward: keep the order
                    self._send_unused(param, ps)
            for ps in layer.early.values():
                if not ps.gradient_pending:
                    ps.start_gradient_comm(self._zeros(ps))
            for param in layer.params:  # a rank "has" a gradient if it used the parameter or
                has = self._used[id(param)] or param.grad is not None  # holds a .grad
                used.append(1.0 if has else 0.0)
                self._used[id(param)] = False
        assert self._session is not None  # a gradient arrived, so the session exists
        usage = self._session.operations[0].parameter_sets[0]  # registered first
        self.updates.all_used_here = all(used)
        kind = dict(dtype=usage.spec.dtype, device=usage.spec.device)
        # the usual case, every parameter used here, needs no host-to-device copy
        flags = torch.ones(len(used), **kind) if all(used) else torch.tensor(used, **kind)
        usage.start_gradient_comm(flags)
        if self.distributed_update:
            if self.updates.updater is None:
                raise RuntimeError("DataParallel(distributed_update=True) needs a "
                                   "DistributedOptimizer to apply the sharded update")
        elif self.updates.mode == "sync":
            self.updates.gradients_to_grad()
        else:  # overlap: the parameters the optimizer does not hold get DDP's .grad now
            self.updates.outside_to_grad()
        self._session.statistics.end_iteration()
        self._exchanges += 1
