"""An :class:`~scaleout.pytorch.embeddings.EmbeddingCollection`'s tables whole: gathered
on every rank (to save them as one model's), and cut back to a rank's part (to load them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.embeddings.planner import COLUMN_WISE, ROW_WISE, ShardingPlan, TableSpec

__all__ = ["gather_full_state", "part_of_full_state"]


def gather_full_state(comm: Communicator, plan: ShardingPlan, tables: Sequence[TableSpec],
                      weight: Callable[[int], torch.Tensor], like: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
    """Every table's weight on every rank (a broadcast from each owner, an allgatherv of a
    row-wise table's blocks, of a column-wise one's columns), keyed ``"<t>.weight"``.

    Args:
        weight: this rank's weight (or block) of a table it holds, by index.
        like: a tensor of the tables' dtype and device (for the tables it receives).
    """
    out = {}
    for t, (spec, owner) in enumerate(zip(tables, plan.owners)):
        if owner in (ROW_WISE, COLUMN_WISE):
            mine = weight(t).detach()
            if owner == COLUMN_WISE:  # gather the columns as rows of the transpose
                counts = [plan.cols_of(t, r)[1] for r in range(comm.size)]
                gathered = collectives.allgatherv(comm, mine.t().contiguous(), counts).wait()
                out[f"{t}.weight"] = gathered.t().contiguous()
            else:
                counts = [plan.rows_of(t, r)[1] for r in range(comm.size)]
                out[f"{t}.weight"] = collectives.allgatherv(comm, mine, counts).wait()
            continue
        if owner == comm.rank:
            buffer = weight(t).detach().clone()
        else:
            buffer = like.new_empty(spec.rows, spec.dim)
        out[f"{t}.weight"] = collectives.bcast(comm, buffer, owner).wait()
    return out


def part_of_full_state(plan: ShardingPlan, tables: Sequence[TableSpec], held: Sequence[int],
                       rank: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of full tables keyed ``"<t>.weight"``: the tables it holds
    (``held``), its rows (or columns) of split ones. A table ``state`` lacks is left out:
    ``load_state_dict`` reports its key missing (raises with ``strict``), on the ranks that
    hold it.

    Raises:
        ValueError: a table it holds is not of its full ``(rows, dim)`` shape (its block
            would be sliced out of another table).
    """
    mine = {}
    for t in (t for t in held if f"{t}.weight" in state):
        full, expected = tuple(state[f"{t}.weight"].shape), (tables[t].rows, tables[t].dim)
        if full != expected:
            raise ValueError(f"EmbeddingCollection.load_full_state: table {t} needs a full "
                             f"weight of shape {expected}, got {full}")
        first, count = plan.rows_of(t, rank)
        column, width = plan.cols_of(t, rank)
        mine[f"{t}.weight"] = state[f"{t}.weight"][first: first + count, column: column + width]
    return mine
