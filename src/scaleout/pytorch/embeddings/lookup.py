"""Step 3 of the collection's forward: a holder looks up the ids the ranks asked it for.

The tables a rank holds whole and its blocks of row-wise tables are looked up together,
every id of every such table in one gather from their batched weight
(:class:`~scaleout.pytorch.embeddings.batched.TableBatch`); a row-wise table's block answers
the ids in its rows and zeros for the others. A column-wise block answers its columns and
zeros elsewhere, a lookup of its own (the blocks are summed on the asking rank). The lookups
are sparse: their backward leaves row gradients on the tables.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from scaleout.pytorch.embeddings.batched import TableBatch
from scaleout.pytorch.embeddings.planner import COLUMN_WISE, ShardingPlan

__all__ = ["look_up"]


def look_up(batch: TableBatch, weights: Mapping[int, torch.Tensor], plan: ShardingPlan,
            rank: int, ids: torch.Tensor, asked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows for ``ids``: the other ranks' requests side by side, each rank's in the order of
    my tables (``asked[rank, j]`` ids of my ``j``-th table).

    Args:
        batch: my tables' batched weight (every table but column-wise blocks).
        weights: my tables' weights (my block of a split table), by table index.
        plan: who holds what. rank: mine in the data group.
        ids: the ids asked for (of my tables, rank by rank). asked: ``(ranks, my tables)``.
        dtype: the tables' dtype (for a rank that holds none).

    Returns:
        ``(len(ids), dim)`` rows, in the tables' autograd graph.
    """
    mine = plan.tables_of(rank)
    dim = plan.tables[0].dim
    if not mine:
        return torch.zeros(0, dim, dtype=dtype, device=ids.device)
    table_of = torch.repeat_interleave(
        torch.arange(len(mine), device=ids.device).repeat(asked.shape[0]),
        asked.reshape(-1).to(ids.device))
    if batch.members:
        looked = batch.look_up(batch.rows(ids, table_of), table_of,
                               [weights[mine[j]] for j in batch.members])
    else:  # only column-wise blocks
        looked = weights[mine[0]].new_zeros(ids.shape[0], dim)
    for j, t in enumerate(mine):  # column-wise blocks: each its own lookup
        if plan.owners[t] == COLUMN_WISE:
            at = (table_of == j).nonzero().squeeze(1)
            looked = looked.index_add(0, at, _columns(weights[t], plan, rank, t, ids[at]))
    return looked


def _columns(weight: torch.Tensor, plan: ShardingPlan, rank: int, table: int,
             ids: torch.Tensor) -> torch.Tensor:
    """My columns of the rows ``ids`` of a column-wise table, zeros in the others."""
    dim = plan.tables[table].dim
    column, width = plan.cols_of(table, rank)
    if width == 0:
        return weight.new_zeros(ids.shape[0], dim)
    looked = F.embedding(ids, weight, sparse=True)
    return F.pad(looked, (column, dim - column - width))
