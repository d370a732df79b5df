"""Step 3 of the collection's forward: a holder looks up the ids the ranks asked it for.

Each table is looked up once for every rank's ids of it (grouped by table, then put back in
the requests' order); a row-wise table's block answers the ids in its rows and zeros for
the others, a column-wise one its columns and zeros elsewhere (the blocks are summed on the
asking rank). The lookups are sparse: their backward leaves row gradients on the tables.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from scaleout.pytorch.embeddings.planner import COLUMN_WISE, ROW_WISE, ShardingPlan

__all__ = ["look_up"]


def look_up(weights: Mapping[int, torch.Tensor], plan: ShardingPlan, rank: int,
            ids: torch.Tensor, asked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows for ``ids``: the other ranks' requests side by side, each rank's in the order of
    my tables (``asked[rank, j]`` ids of my ``j``-th table).

    Args:
        weights: my tables' weights (my block of a split table), by table index.
        plan: who holds what. rank: mine in the data group.
        ids: the ids asked for (of my tables, rank by rank). asked: ``(ranks, my tables)``.
        dtype: the tables' dtype (for a rank that holds none).

    Returns:
        ``(len(ids), dim)`` rows, in the tables' autograd graph.
    """
    mine = plan.tables_of(rank)
    dim = plan.tables[0].dim
    if not mine:  # (requires grad: the backward exchange must run here too)
        return torch.zeros(0, dim, dtype=dtype, device=ids.device, requires_grad=True)
    table_of = torch.repeat_interleave(
        torch.arange(len(mine), device=ids.device).repeat(asked.shape[0]),
        asked.reshape(-1).to(ids.device))
    order = torch.argsort(table_of, stable=True)  # grouped by table, then back
    sizes = torch.bincount(table_of, minlength=len(mine)).tolist()
    grouped = ids[order].split(sizes)
    looked = torch.cat([_lookup(weights[t], plan, rank, t, part)
                        for t, part in zip(mine, grouped)])
    return looked[torch.argsort(order)]


def _lookup(weight: torch.Tensor, plan: ShardingPlan, rank: int, table: int,
            ids: torch.Tensor) -> torch.Tensor:
    dim = plan.tables[table].dim
    if plan.owners[table] == COLUMN_WISE:  # my columns, zeros elsewhere: summed later
        column, width = plan.cols_of(table, rank)
        if width == 0:
            return weight.new_zeros(ids.shape[0], dim)
        looked = F.embedding(ids, weight, sparse=True)
        return F.pad(looked, (column, dim - column - width))
    if plan.owners[table] != ROW_WISE:
        return F.embedding(ids, weight, sparse=True)
    first, count = plan.rows_of(table, rank)
    outside = (ids < first) | (ids >= first + count)
    if count == 0:
        return weight.new_zeros(ids.shape[0], dim)
    local = torch.where(outside, torch.zeros_like(ids), ids - first)
    return F.embedding(local, weight, sparse=True).masked_fill(outside.unsqueeze(1), 0.0)
