"""Row-wise sparse optimizer for embedding tables (FBGEMM / TorchRec's default)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["RowWiseAdagrad", "row_wise_adagrad_"]


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row, updating only the rows a batch touched.

    For a row ``i`` with gradient ``g`` (a vector of the table's width):
    ``state[i] += mean(g**2)``; ``w[i] -= lr * g / (sqrt(state[i]) + eps)``. Optimizer state
    is one value per row (``1/dim`` of full Adagrad's), and the work per step is
    proportional to the rows touched, not to the table. Dense gradients are accepted too
    (every row is then touched; rows with a zero gradient do not change).

    On a column-wise table (``COLUMN_WISE``: each rank holds some of every row's columns) the
    mean is over this rank's columns only, so each block keeps its own accumulator and the
    updates differ from those of the unsplit table (whole and row-wise tables match it).

    Args:
        params: the tables' weights (2-D).
        lr: learning rate, > 0. eps: added to the root, > 0.

    Raises:
        ValueError: ``lr`` or ``eps`` not > 0, or a parameter that is not 2-D.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 0.01,
                 eps: float = 1e-8) -> None:
        if not lr > 0 or not eps > 0:
            raise ValueError(f"RowWiseAdagrad: lr and eps must be > 0, got lr={lr}, eps={eps}")
        super().__init__(params, {"lr": lr, "eps": eps})
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad updates 2-D tables, got a parameter of "
                                     f"shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "sum" not in state:
                    state["sum"] = param.new_zeros(param.shape[0])
                if grad.is_sparse:
                    grad = grad.coalesce()
                    rows, values = grad.indices()[0], grad.values()
                else:
                    rows = grad.abs().sum(1).nonzero().squeeze(1)
                    values = grad[rows]
                if rows.numel() == 0:
                    continue
                row_wise_adagrad_(param, state["sum"], rows, values, group["lr"], group["eps"])
        return loss


def row_wise_adagrad_(param: torch.Tensor, total: torch.Tensor, rows: torch.Tensor,
                      values: torch.Tensor, lr: float, eps: float) -> None:
    """One row-wise Adagrad update in place: ``total[i] += mean(g**2)``, ``param[i] -= lr * g
    / (sqrt(total[i]) + eps)`` for each of ``rows`` (distinct) and its gradient ``g`` in
    ``values``. A row with a zero gradient does not change."""
    accumulated = total.index_add_(0, rows, values.pow(2).mean(1))[rows]
    param.index_add_(0, rows, values / (accumulated.sqrt() + eps).unsqueeze(1), alpha=-lr)
