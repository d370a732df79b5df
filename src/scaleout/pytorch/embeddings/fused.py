"""Table updates fused into backward (FBGEMM's TBE, TorchRec's fused embedding optimizer).

With :meth:`EmbeddingCollection.update_in_backward`, the lookups' backward updates the rows
it reaches at once instead of leaving each table a sparse ``.grad`` for an optimizer step.
The rows of every table a rank holds whole, and of its blocks of row-wise tables, lie in one
batched weight (:class:`~scaleout.pytorch.embeddings.batched.TableBatch`): their update is
one ``index_add_`` for all of them, with no per-table sparse gradient, no accumulation into
``.grad`` and no per-table optimizer step (a DLRM rank's 13 tables and ~4,000 ids: 0.5-0.85
ms instead of 1.2-1.9 ms with the lookup, on this project's 2-core machine: docs/hybrid.md).
A column-wise block, kept apart, is updated as soon as its own sparse gradient is
accumulated (a post-accumulate hook), and its ``.grad`` cleared.

The rules are the row-wise ones a sparse update can apply exactly: plain SGD, and row-wise
Adagrad (the same update as :class:`~scaleout.pytorch.embeddings.optim.RowWiseAdagrad`).
Their ``lr`` may be changed between steps (a schedule). Each backward updates the tables:
gradients are not accumulated over several backwards (micro-batches) as with a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scaleout.pytorch.embeddings.optim import row_wise_adagrad_

__all__ = ["FusedRowWiseAdagrad", "FusedSGD", "InBackward"]


class FusedSGD:
    """Plain SGD applied in backward: ``w[i] -= lr * g`` for each row a batch touched (a row
    asked for twice takes both gradients). The same update as ``torch.optim.SGD`` without
    momentum or weight decay on the tables' sparse gradients.

    Args:
        lr: learning rate, > 0.

    Raises:
        ValueError: ``lr`` not > 0.

    Example (each rank):
        >>> ec.update_in_backward(FusedSGD(lr=0.1))   # no optimizer for the tables
        >>> loss_fn(model(x), y).backward()            # the tables' rows are updated here
    """

    def __init__(self, lr: float) -> None:
        _check_positive(type(self).__name__, lr=lr)
        self.lr = lr

    def apply(self, key: str, weight: torch.Tensor, rows: torch.Tensor,
              values: torch.Tensor) -> None:
        """Update ``weight``'s ``rows`` (repeats allowed) by their gradients ``values``
        (``key`` names the weight; SGD keeps no state)."""
        weight.index_add_(0, rows, values.to(weight.dtype), alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr = state["lr"]


class FusedRowWiseAdagrad:
    """Row-wise Adagrad applied in backward (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): for a row
    ``i`` with gradient ``g``, the sum of its gradients in this backward, ``acc[i] +=
    mean(g**2)``, ``w[i] -= lr * g / (sqrt(acc[i]) + eps)``; one accumulator per row.

    Summing a row's gradients needs their distinct rows, whose count ``torch.unique`` brings
    to the host (one synchronisation per backward on a GPU).

    Args:
        lr: learning rate, > 0. eps: added to the root, > 0.

    Raises:
        ValueError: ``lr`` or ``eps`` not > 0.
    """

    def __init__(self, lr: float = 0.01, eps: float = 1e-8) -> None:
        _check_positive(type(self).__name__, lr=lr, eps=eps)
        self.lr, self.eps = lr, eps
        self.state: dict[str, torch.Tensor] = {}  # each weight's accumulators, by its key

    def apply(self, key: str, weight: torch.Tensor, rows: torch.Tensor,
              values: torch.Tensor) -> None:
        """Update ``weight``'s ``rows`` (repeats allowed: summed first) by ``values``; ``key``
        names the weight's accumulators (``"batch"``, ``"table <t>"``)."""
        rows, inverse = torch.unique(rows, return_inverse=True)
        summed = weight.new_zeros(rows.shape[0], weight.shape[1]).index_add_(
            0, inverse, values.to(weight.dtype))
        total = self.state.get(key)
        if total is None:
            total = self.state[key] = weight.new_zeros(weight.shape[0])
        elif total.device != weight.device or total.dtype != weight.dtype:
            total = self.state[key] = total.to(weight)
        row_wise_adagrad_(weight, total, rows, summed, self.lr, self.eps)

    def state_dict(self) -> dict[str, Any]:
        """``lr``, ``eps`` and the accumulators (load them into a collection of the same
        plan)."""
        return {"lr": self.lr, "eps": self.eps, "state": dict(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.eps = state["lr"], state["eps"]
        self.state = {k: v.clone() for k, v in state["state"].items()}


FusedRule = FusedSGD | FusedRowWiseAdagrad


class InBackward:
    """:meth:`EmbeddingCollection.update_in_backward`'s handle: ``rule`` is the update;
    ``remove()`` stops it (the tables then get sparse ``.grad`` again for an optimizer)."""

    def __init__(self, rule: FusedRule, batch: Any, hooks: Sequence[Any]) -> None:
        self.rule, self._batch, self._hooks = rule, batch, list(hooks)

    def remove(self) -> None:
        self._batch.update = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def block_hook(rule: FusedRule, key: str) -> Any:
    """A post-accumulate-grad hook that updates a table's block kept apart from the batched
    weight (a column-wise block) by its gradient, then clears the ``.grad``."""

    def update(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if grad is None:
            return
        if grad.is_sparse:
            grad = grad.coalesce()
            rows, values = grad.indices()[0], grad.values()
        else:
            rows, values = torch.arange(grad.shape[0], device=grad.device), grad
        with torch.no_grad():
            rule.apply(key, param, rows, values)
    return update


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
        if not value > 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")
