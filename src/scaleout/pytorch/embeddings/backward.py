"""How the tables' backward runs: blocking (the default), deferred, or updating the tables.

:class:`TableBackward` is the part of
:class:`~scaleout.pytorch.embeddings.collection.EmbeddingCollection` that chooses it:
:meth:`~TableBackward.defer_backward` lets the rows' gradients travel while the rest of
backward runs (:mod:`~scaleout.pytorch.embeddings.rows_exchange`), and
:meth:`~TableBackward.update_in_backward` applies the tables' update in the lookups' backward
instead of leaving sparse gradients (:mod:`~scaleout.pytorch.embeddings.fused`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaleout.pytorch.embeddings.batched import TableBatch
from scaleout.pytorch.embeddings.fused import (
    FusedRowWiseAdagrad,
    FusedRule,
    FusedSGD,
    InBackward,
    block_hook,
)
from scaleout.pytorch.embeddings.planner import COLUMN_WISE, ShardingPlan
from scaleout.pytorch.embeddings.rows_exchange import Deferral, Landing

__all__ = ["TableBackward"]


class TableBackward(nn.Module):
    """The collection's backward options (a base class: the collection sets the attributes
    annotated below)."""

    plan: ShardingPlan
    _batch: TableBatch
    _landing: Landing

    def held(self) -> list[int]:  # (the collection's)
        raise NotImplementedError

    def defer_backward(self, optimizer: torch.optim.Optimizer | None) -> Deferral:
        """Let the rows' gradients travel back to the tables' holders while the rest of
        backward runs, and land them before every ``optimizer.step()`` (a step pre-hook).

        Without it, backward blocks on that exchange when it reaches the tables (the dense
        layers' backward below them and their allreduce wait behind it). With it, backward
        only starts the exchange; :meth:`land_gradients` waits for it and writes the tables'
        sparse gradients, the same ones: it runs before ``optimizer`` steps and before
        anything reads the tables (:meth:`forward`, :meth:`start_lookup`, :meth:`drain`), so
        a second backward without a step between accumulates as usual.

        Args:
            optimizer: the tables' optimizer (with :meth:`update_in_backward`, which
                leaves none, any optimizer stepped after backward: the dense one); ``None``
                on a rank that holds no table (its part of the exchange then lands at its
                next forward or lookup).

        Returns:
            A handle: ``.remove()`` lands what is pending, removes the hook and makes
            backward block again.

        Raises:
            TypeError: ``optimizer`` is neither a ``torch.optim.Optimizer`` nor ``None``.

        Example (each rank):
            >>> ec.defer_backward(table_opt)   # table_opt's step waits for the gradients
            >>> loss_fn(model(inputs), targets).backward()   # returns before they land
            >>> dense_opt.step(); table_opt.step()
        """
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"EmbeddingCollection.defer_backward: expected a torch optimizer "
                            f"or None, got {type(optimizer).__name__}")
        hook = None if optimizer is None else optimizer.register_step_pre_hook(self._land_hook)
        self._landing.active = True
        return Deferral(self._landing, hook)

    def update_in_backward(self, rule: FusedRule) -> InBackward:
        """Update the tables in backward by ``rule`` (FBGEMM / TorchRec's fused optimizer),
        with no optimizer for them.

        The lookups' backward updates the rows it reaches: one ``index_add_`` over the
        batched weight of every table held whole and block of rows, instead of a sparse
        ``.grad`` per table, its accumulation and a step per table; a column-wise block is
        updated once its own gradient is accumulated. The tables' ``.grad`` stay ``None``.
        Each backward updates (no accumulation over micro-batches); with
        :meth:`defer_backward`, when the gradients land. Call it on every rank of the data
        group (a rank holding no table has nothing to update). Not with a
        ``torch.amp.GradScaler``: the rule steps with the scaled gradient, before the scaler
        could unscale it or skip the step (docs/hybrid.md).

        Args:
            rule: :class:`~scaleout.pytorch.embeddings.fused.FusedSGD` or
                :class:`~scaleout.pytorch.embeddings.fused.FusedRowWiseAdagrad`.

        Returns:
            A handle: ``.rule`` is ``rule``; ``.remove()`` restores sparse ``.grad``.

        Raises:
            TypeError: ``rule`` is neither rule.
            RuntimeError: the tables are updated in backward already.

        Example (each rank; ``dense_opt`` steps the data-parallel layers only):
            >>> ec.update_in_backward(FusedSGD(lr=0.1))
            >>> loss_fn(model(x), y).backward(); dense_opt.step()
        """
        if not isinstance(rule, (FusedSGD, FusedRowWiseAdagrad)):
            raise TypeError(f"EmbeddingCollection.update_in_backward: expected FusedSGD or "
                            f"FusedRowWiseAdagrad, got {type(rule).__name__}")
        if self._batch.update is not None:
            raise RuntimeError("EmbeddingCollection.update_in_backward: the tables are updated "
                               "in backward already (remove() the handle first)")
        hooks = [self.get_submodule(str(t)).weight.register_post_accumulate_grad_hook(
                 block_hook(rule, f"table {t}"))
                 for t in self.held() if self.plan.owners[t] == COLUMN_WISE]
        self._batch.update = rule
        return InBackward(rule, self._batch, hooks)

    def _land_hook(self, *_: Any) -> None:  # (a step pre-hook must return None)
        self.land_gradients()

    def land_gradients(self) -> bool:
        """Wait for the rows' gradients whose exchange a deferred backward started and
        write the tables' sparse gradients (:meth:`defer_backward`); whether any was
        pending (``False`` without deferral)."""
        return self._landing.land()

    def get_extra_state(self) -> dict[str, Any]:
        """Checkpointed with ``state_dict()``: the update in backward's rule and its state
        (row-wise Adagrad's accumulators), which no optimizer holds; ``None`` without one."""
        rule = self._batch.update
        return {"update_in_backward": None if rule is None else
                {"rule": type(rule).__name__, "state": rule.state_dict()}}

    def set_extra_state(self, state: Any) -> None:
        """Restored by ``load_state_dict()``: the rule's state, into the rule this collection
        updates with now (of the same kind: call :meth:`update_in_backward` first).

        Raises:
            ValueError: see :meth:`check_extra_state`.
        """
        self.check_extra_state(state)
        saved = state["update_in_backward"]
        if saved is not None:
            self._batch.update.load_state_dict(saved["state"])

    def check_extra_state(self, state: Any) -> None:
        """Whether :meth:`set_extra_state` takes ``state``, changing nothing
        (:func:`scaleout.checkpoint.load` asks every module before it restores any).

        Raises:
            ValueError: state saved with a rule and no rule (or another kind) here, or
                accumulators of other tables than this rank's (another plan).
        """
        if not isinstance(state, dict) or "update_in_backward" not in state:
            raise ValueError("EmbeddingCollection extra state must be a dict with an "
                             "'update_in_backward' entry")
        saved = state["update_in_backward"]
        if saved is None:
            return
        rule = self._batch.update
        if rule is None or type(rule).__name__ != saved["rule"]:
            here = "none" if rule is None else type(rule).__name__
            raise ValueError(f"EmbeddingCollection.load_state_dict: the tables were updated in "
                             f"backward by {saved['rule']} when saved, here by {here}: call "
                             f"update_in_backward({saved['rule']}(...)) before loading")
        rows = {"batch": self._batch.weight.shape[0]}
        rows.update({f"table {t}": self.get_submodule(str(t)).weight.shape[0]
                     for t in self.held() if self.plan.owners[t] == COLUMN_WISE})
        for key, value in saved["state"].get("state", {}).items():
            if rows.get(key) != value.shape[0]:
                raise ValueError(f"EmbeddingCollection.load_state_dict: {saved['rule']}'s "
                                 f"accumulators for {key!r} have {value.shape[0]} rows, this "
                                 f"rank's tables {rows.get(key, 'none')} (saved with another "
                                 "plan)")
