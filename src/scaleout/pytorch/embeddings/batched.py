"""Table-batched lookups (FBGEMM's TBE): a rank's tables' rows in one weight.

Every table a rank holds whole, and its block of rows of every row-wise table, are views of
one ``(rows, dim)`` weight, one table after the other (column-wise blocks, narrower, stay
apart). Each table keeps its own ``nn.Embedding`` parameter (its state dict, its optimizer
state, its ``.grad``), aliasing its rows of the batched weight, so a lookup of every id of
every such table is one gather, with no grouping by table, and its backward one pass that
cuts the ids' gradients into each table's sparse gradient (one sort, however many tables).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TableBatch"]


class TableBatch:
    """The batched weight of a rank's tables and where each table's rows lie in it.

    Args:
        blocks: for each table this rank holds (in its order), ``(first, count)``: the
            table's rows held here (``0, rows`` for a whole table), or ``None`` for a
            table kept apart (a column-wise block).
        rows: the tables' rows (whole). dim: their width. dtype: the weight's.
    """

    def __init__(self, blocks: Sequence[tuple[int, int] | None], rows: Sequence[int],
                 dim: int, dtype: torch.dtype) -> None:
        counts = [0 if b is None else b[1] for b in blocks]
        firsts = [0 if b is None else b[0] for b in blocks]
        self.dim = dim
        self.starts = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0).tolist()
        self.counts = counts
        self.weight = torch.zeros(self.starts[-1], dim, dtype=dtype)
        self.members = [j for j, b in enumerate(blocks) if b is not None]
        # an id of table j is row id + shift[j] of the weight if lo[j] <= id < hi[j]
        self.shift = torch.tensor([s - f for s, f in zip(self.starts, firsts)])
        self.lo = torch.tensor(firsts)
        self.hi = torch.tensor([f + c for f, c in zip(firsts, counts)])
        # only whole tables: every id asked for is held (ids are checked to be in range)
        self.whole = all(b is not None and tuple(b) == (0, r) for b, r in zip(blocks, rows))
        self._indices: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        # a fused rule (``embeddings.fused``): its ``apply`` updates the batched weight in
        # backward, instead of the members getting sparse grads (``update_in_backward``)
        self.update: Any = None

    def indices(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``shift``, ``lo``, ``hi`` and the tables' ``starts`` on ``device``, copied there
        once (every lookup and its backward read them)."""
        if device not in self._indices:
            starts = torch.tensor(self.starts)
            self._indices[device] = tuple(t.to(device) for t in (self.shift, self.lo, self.hi,
                                                                  starts))
        return self._indices[device]

    def view(self, j: int) -> torch.Tensor:
        """Table ``j``'s rows of the batched weight (a view: writes go to both)."""
        return self.weight[self.starts[j]: self.starts[j] + self.counts[j]]

    def bind(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The batched weight, with ``weights`` (the members', in order) its views again
        if any stopped being one (``module.to``, ``.double()`` replace a parameter's data:
        the weight is then rebuilt from them, and their data made views of it)."""
        base = self.weight
        size = base.element_size() * self.dim
        if all(w.dtype == base.dtype and w.device == base.device
               and w.data_ptr() == base.data_ptr() + self.starts[j] * size
               for j, w in zip(self.members, weights)):
            return base
        self.weight = torch.cat([w.detach() for w in weights]) if weights else base
        for j, w in zip(self.members, weights):
            w.data = self.view(j)
        return self.weight

    def rows(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The batched weight's row of each id (``table[i]``: the id's table, by its index
        among the rank's; ids checked to be in their tables' rows), ``-1`` for an id not
        held here (another rank's block of a row-wise table, or a table kept apart)."""
        shift, lo, hi, _ = self.indices(ids.device)
        rows = ids + shift.index_select(0, table)
        if self.whole:  # every id is held here
            return rows
        held = (ids >= lo.index_select(0, table)) & (ids < hi.index_select(0, table))
        return torch.where(held, rows, -1)

    def look_up(self, rows: torch.Tensor, table: torch.Tensor,
                weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The rows (zeros where ``rows`` is ``-1``), in the members' autograd graph: one
        gather forward; backward gives each member a sparse gradient of the rows it gave."""
        return _Lookup.apply(rows, table, self, self.bind(weights), *weights)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, table: torch.Tensor, batch: TableBatch,
                weight: torch.Tensor, *members: torch.Tensor) -> torch.Tensor:
        ctx.batch = batch
        ctx.save_for_backward(rows)
        if weight.shape[0] == 0:
            return weight.new_zeros(rows.shape[0], batch.dim)
        if batch.whole:
            return weight.index_select(0, rows)
        looked = weight.index_select(0, rows.clamp(min=0))
        return looked.masked_fill_((rows < 0).unsqueeze(1), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (rows,) = ctx.saved_tensors
        batch = ctx.batch
        if batch.update is not None:  # one update of every table's rows, no .grad
            if batch.weight.shape[0] > 0:
                if not batch.whole:  # an id not held here: a zero gradient to row 0 (no change)
                    held = rows >= 0
                    rows, grad = rows.clamp(min=0), grad * held.unsqueeze(1)
                with torch.no_grad():
                    batch.update.apply("batch", batch.weight, rows, grad)
            return (None,) * (4 + len(batch.members))
        # sorted, the rows fall into the tables' ranges one after the other (-1s first)
        rows, order = torch.sort(rows)
        bounds = torch.searchsorted(rows, batch.indices(rows.device)[3])
        bounds = bounds.tolist()
        # each table's values gathered apart, not slices of one buffer: autograd keeps a
        # table's first gradient as its ``.grad``, which the next backward's sparse add_
        # grows in place (into the next table's values, were they in the same buffer)
        grads = [torch.sparse_coo_tensor(
            (rows[bounds[j]: bounds[j + 1]] - batch.starts[j]).unsqueeze(0),
            grad.index_select(0, order[bounds[j]: bounds[j + 1]]), (batch.counts[j], batch.dim),
            check_invariants=False)
            for j in batch.members]
        return None, None, None, None, *grads
