"""Which rank holds which embedding table: a planner that balances memory and lookup cost.

Table-wise sharding (TorchRec's ``TABLE_WISE``): a table lives whole on one rank. The
planner places the tables largest first, each on the rank whose load (its share of all
table bytes plus its share of all lookup work) is lowest among those with room left under
the memory budget (the longest-processing-time rule). A table that fits on no rank is
sharded row-wise (``ROW_WISE``): every rank holds a contiguous block of its rows. An explicit
:class:`ShardingPlan` may also split a table column-wise (``COLUMN_WISE``): every rank holds
all rows, a block of the columns.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TableSpec", "ShardingPlan", "plan_tables", "ROW_WISE", "COLUMN_WISE", "row_block"]

#: ``ShardingPlan.owners[t]`` of a table split by rows across every rank.
ROW_WISE = -1
#: ``ShardingPlan.owners[t]`` of a table split by columns across every rank.
COLUMN_WISE = -2
_SPLIT = (ROW_WISE, COLUMN_WISE)


def row_block(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(first row, count)`` of ``rank``'s block when ``rows`` are split over ``ranks``
    (the first ``rows % ranks`` ranks hold one more)."""
    base, extra = divmod(rows, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table.

    Attributes:
        rows: number of ids (>= 1). dim: width of a row (>= 1).
        pooling: average ids looked up per sample (lookup cost), > 0.
        name: for the plan's report.

    Raises:
        ValueError: a size is out of range.
    """

    rows: int
    dim: int
    pooling: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        for field, value in (("rows", self.rows), ("dim", self.dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TableSpec {self.name!r}: {field} must be an int >= 1, got "
                                 f"{value!r}")
        if isinstance(self.pooling, bool) or not isinstance(self.pooling, (int, float)) or \
                not 0 < self.pooling < math.inf:  # (NaN fails too)
            raise ValueError(f"TableSpec {self.name!r}: pooling must be a finite number > 0, "
                             f"got {self.pooling!r}")

    def nbytes(self, element_size: int) -> int:
        """Bytes of its weights."""
        return self.rows * self.dim * element_size


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """The result: ``owners[t]`` is the group rank holding table ``t`` (or :data:`ROW_WISE`,
    :data:`COLUMN_WISE`).

    Attributes:
        tables: the tables, in the model's order.
        owners: one group rank per table.
        ranks: the group size.
        element_size: bytes per weight the plan was made for.
    """

    tables: tuple[TableSpec, ...]
    owners: tuple[int, ...]
    ranks: int
    element_size: int = 4

    def __post_init__(self) -> None:
        if len(self.owners) != len(self.tables):
            raise ValueError(f"ShardingPlan: {len(self.tables)} tables but {len(self.owners)} "
                             "owners")
        # (an owner 0.5 passed the range and then was no rank's: its lookups read zeros)
        bad = [o for o in self.owners if isinstance(o, bool) or not isinstance(o, int)
               or not (0 <= o < self.ranks or o in _SPLIT)]
        if bad:
            raise ValueError(f"ShardingPlan: owners must be ranks 0..{self.ranks - 1}, ROW_WISE "
                             f"or COLUMN_WISE, got {bad}")

    def tables_of(self, rank: int) -> list[int]:
        """Indices of the tables ``rank`` holds whole or a block of, ascending."""
        return [t for t, owner in enumerate(self.owners) if owner == rank or owner in _SPLIT]

    def rows_of(self, table: int, rank: int) -> tuple[int, int]:
        """``(first row, count)`` of ``table`` on ``rank`` (count 0: none)."""
        rows, owner = self.tables[table].rows, self.owners[table]
        if owner == ROW_WISE:
            return row_block(rows, self.ranks, rank)
        return (0, rows) if owner in (rank, COLUMN_WISE) else (0, 0)

    def cols_of(self, table: int, rank: int) -> tuple[int, int]:
        """``(first column, count)`` of ``table`` on ``rank`` (count 0: none)."""
        dim, owner = self.tables[table].dim, self.owners[table]
        if owner == COLUMN_WISE:
            return row_block(dim, self.ranks, rank)
        return (0, dim) if owner in (rank, ROW_WISE) else (0, 0)

    def memory_of(self, rank: int) -> int:
        """Bytes of table weights on ``rank``."""
        return sum(self.rows_of(t, rank)[1] * self.cols_of(t, rank)[1] * self.element_size
                   for t in self.tables_of(rank))

    def lookups_of(self, rank: int) -> float:
        """Rows looked up per sample on ``rank`` (times their width: values moved)."""
        return sum(self.tables[t].pooling * self.tables[t].dim for t in self.tables_of(rank))

    def describe(self) -> str:
        """A table of which rank holds what (one line per rank)."""
        lines = []
        for rank in range(self.ranks):
            held = self.tables_of(rank)
            names = ", ".join((self.tables[t].name or str(t)) + (
                " (rows {}+{})".format(*self.rows_of(t, rank)) if self.owners[t] == ROW_WISE
                else " (columns {}+{})".format(*self.cols_of(t, rank))
                if self.owners[t] == COLUMN_WISE else "") for t in held) or "-"
            lines.append(f"rank {rank}: {len(held)} tables, {self.memory_of(rank) / 2**20:.2f} "
                         f"MiB, {self.lookups_of(rank):g} values/sample: {names}")
        return "\n".join(lines)


def plan_tables(tables: Sequence[TableSpec], ranks: int, *, memory_budget: int | None = None,
                element_size: int = 4) -> ShardingPlan:
    """Place every table on one of ``ranks`` ranks, balancing memory and lookup cost.

    Args:
        tables: the tables, in the model's order.
        ranks: how many ranks share them (the data group's size).
        memory_budget: bytes of table weights one rank may hold (``None``: unlimited).
        element_size: bytes per weight (4 for float32).

    Returns:
        The plan (the same on every rank: it depends only on its arguments).

    Raises:
        ValueError: a table fits neither whole on a rank nor row-wise across all of them
            under ``memory_budget`` (the message names the table, its size and the budget).

    Example:
        >>> plan_tables([TableSpec(rows=1000, dim=16), TableSpec(rows=10, dim=16)], 2).owners
        (0, 1)
    """
    tables = tuple(tables)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or
                                      not isinstance(memory_budget, int) or memory_budget < 1):
        raise ValueError(f"memory_budget must be bytes, an int >= 1, got {memory_budget!r}")
    for t in tables:
        if not isinstance(t, TableSpec):
            raise TypeError(f"tables must hold TableSpec, got {type(t).__name__}")
    total_bytes = sum(t.nbytes(element_size) for t in tables) or 1
    total_lookups = sum(t.pooling * t.dim for t in tables) or 1.0
    memory = [0] * ranks
    load = [0.0] * ranks
    owners = [0] * len(tables)

    def cost(t: TableSpec) -> float:
        return t.nbytes(element_size) / total_bytes + t.pooling * t.dim / total_lookups

    for index in sorted(range(len(tables)), key=lambda i: (-cost(tables[i]), i)):
        table = tables[index]
        size = table.nbytes(element_size)
        room = [r for r in range(ranks)
                if memory_budget is None or memory[r] + size <= memory_budget]
        if not room:
            blocks = [row_block(table.rows, ranks, r)[1] * table.dim * element_size
                      for r in range(ranks)]
            if memory_budget is None or any(m + b > memory_budget
                                            for m, b in zip(memory, blocks)):
                raise ValueError(
                    f"table {table.name or index} ({table.rows} x {table.dim}, {size} bytes) "
                    f"fits on no rank under the memory budget of {memory_budget} bytes per "
                    f"rank, whole or row-wise (ranks hold {memory} bytes already); raise the "
                    "budget or use more ranks")
            owners[index] = ROW_WISE
            for r in range(ranks):
                memory[r] += blocks[r]
                load[r] += cost(table) / ranks
            continue
        best = min(room, key=lambda r: (load[r], memory[r], r))
        owners[index] = best
        memory[best] += size
        load[best] += cost(table)
    return ShardingPlan(tables=tables, owners=tuple(owners), ranks=ranks,
                        element_size=element_size)
