"""EmbeddingCollection: many tables sharded across the data group (DLRM / TorchRec).

Forward, on every rank of the data group (each with its own samples):

1. ids: an alltoallv sends each table's column of ids to the rank that holds the table (a
   row-wise table's column to every rank);
2. lookup: each rank looks up its tables for the samples of every rank (a row-wise table:
   the ids in its block of rows, zeros for the others, the blocks summed in step 3);
3. results: an alltoallv sends each sample's vectors back to the rank that owns the sample
   (MLSL's model-parallel -> data-parallel transition, an all-to-all).

Backward is the reverse alltoallv of the gradients (step 3 inverted), which reach the table
weights as sparse row gradients, scaled like DataParallel's average over the data group; the
tables are then updated by a row-wise optimizer (``RowWiseAdagrad``, or torch's SGD / Adagrad
/ SparseAdam, which accept sparse gradients). The dense layers around stay data parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.embeddings.planner import (
    COLUMN_WISE,
    ROW_WISE,
    ShardingPlan,
    TableSpec,
    plan_tables,
)
from scaleout.pytorch.exchange_stats import ExchangeRecorder
from scaleout.pytorch.placement import Kind, Placement, place

__all__ = ["EmbeddingCollection"]


class _Route:
    """Who holds which table and how many samples each rank has this iteration."""

    def __init__(self, comm: Communicator, plan: ShardingPlan, batches: list[int],
                 divisor: int, recorder: ExchangeRecorder) -> None:
        self.comm = comm
        self.recorder = recorder
        self.held = [plan.tables_of(r) for r in range(comm.size)]
        self.mine = self.held[comm.rank]
        self.batches = batches
        self.divisor = divisor
        self.tables = len(plan.tables)
        # every rank's lookups side by side ("slots"): a row-wise table has one per rank
        self.slots = torch.tensor([t for held in self.held for t in held], dtype=torch.int64)

    @property
    def batch(self) -> int:
        return self.batches[self.comm.rank]


class _Results(torch.autograd.Function):
    """Lookups of this rank's tables for every rank's samples -> every table for mine."""

    @staticmethod
    def forward(ctx: Any, looked: torch.Tensor, route: _Route) -> torch.Tensor:
        ctx.route = route
        dim = looked.shape[-1]
        send = [b * len(route.mine) for b in route.batches]
        recv = [route.batch * len(held) for held in route.held]
        flat = looked.reshape(-1, dim)
        got = route.recorder.run(flat, lambda: collectives.alltoallv(
            route.comm, flat, send, recv).wait())
        blocks = [block.view(route.batch, len(held), dim)
                  for block, held in zip(got.split(recv), route.held)]
        out = looked.new_zeros(route.batch, route.tables, dim)  # row-wise blocks: summed
        return out.index_add_(1, route.slots.to(out.device), torch.cat(blocks, dim=1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        route = ctx.route
        dim = grad.shape[-1]
        by_owner = grad[:, route.slots.to(grad.device)].contiguous()
        parts = by_owner.split([len(h) for h in route.held], dim=1)
        send = torch.cat([p.reshape(-1, dim) for p in parts])
        recv = [b * len(route.mine) for b in route.batches]
        got = route.recorder.run(send, lambda: collectives.alltoallv(
            route.comm, send, [p.numel() // dim for p in parts], recv).wait())
        got = got.view(sum(route.batches), len(route.mine), dim)
        return got / route.divisor if route.divisor > 1 else got, None


class EmbeddingCollection(nn.Module):
    """Embedding tables sharded across the data group; ``(B, T)`` ids -> ``(B, T, dim)``.

    Column ``t`` of the ids indexes table ``t`` (one id per table per sample, as in DLRM).
    Each rank holds only its tables (whole, or its block of rows of a ``ROW_WISE`` table, or
    of columns of a ``COLUMN_WISE`` one),
    registered as submodules named by the table index (``"3"``), so an owner's state dict
    has the keys of an ``nn.ModuleList`` of ``nn.Embedding``; :meth:`full_state` gathers
    every table on every rank.

    Args:
        tables: the tables (all with one ``dim``).
        distribution: the grid; tables are spread over its DATA group (each rank of a model
            group holds the same ones).
        plan: who holds what; default :func:`plan_tables` (balanced, unlimited memory).
        dtype: weight dtype.
        init: ``init(table_index, weight, first_row, first_column)`` fills this rank's block
            of a table in place (default: DLRM's uniform +-rows^-0.5 from a generator seeded
            by the table index, the same values whichever rank holds them).

    Raises:
        ValueError: tables of different widths, or a plan for other tables or ranks.

    Example (2 ranks; rank 0 holds tables 0 and 3, rank 1 tables 1 and 2):
        >>> ec = EmbeddingCollection([TableSpec(rows=r, dim=8) for r in (9, 5, 4, 2)], dist)
        >>> ec(torch.zeros(6, 4, dtype=torch.long)).shape   # this rank's 6 samples
        torch.Size([6, 4, 8])
    """

    def __init__(self, tables: Sequence[TableSpec], distribution: Distribution, *,
                 plan: ShardingPlan | None = None, dtype: torch.dtype = torch.float32,
                 init: Any = None) -> None:
        super().__init__()
        tables = tuple(tables)
        if not tables:
            raise ValueError("EmbeddingCollection needs at least one table")
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"EmbeddingCollection: every table must have one dim, got "
                             f"{sorted(dims)}")
        self.comm = distribution.communicator(GroupType.DATA)
        self.divisor = distribution.size(GroupType.DATA)
        self.plan = plan or plan_tables(tables, self.comm.size,
                                        element_size=torch.empty((), dtype=dtype).element_size())
        shapes = [(t.rows, t.dim) for t in tables]
        planned = [(t.rows, t.dim) for t in self.plan.tables]
        if planned != shapes or self.plan.ranks != self.comm.size:
            raise ValueError(f"EmbeddingCollection: the plan is for tables {planned} on "
                             f"{self.plan.ranks} ranks, got tables {shapes} on a data group of "
                             f"{self.comm.size}")
        self.tables = tables
        self.exchange_recorder = ExchangeRecorder()
        self.dim = dims.pop()
        self.dtype = dtype
        for t in self.plan.tables_of(self.comm.rank):
            first, count = self.plan.rows_of(t, self.comm.rank)
            column, width = self.plan.cols_of(t, self.comm.rank)
            table = nn.Embedding(max(count, 1), max(width, 1), sparse=True, dtype=dtype)
            table.weight.data = table.weight.data[:count, :width]  # a rank may hold nothing
            with torch.no_grad():
                if init is not None:
                    init(t, table.weight, first, column)
                else:
                    _dlrm_init(tables[t], t, table.weight, first, column)
            place(table.weight, Placement(kind=Kind.LOCAL, layer=f"table {t}"))
            self.add_module(str(t), table)

    @classmethod
    def from_embeddings(cls, embeddings: Sequence[nn.Embedding], distribution: Distribution, *,
                        plan: ShardingPlan | None = None) -> EmbeddingCollection:
        """Shard existing tables (every rank passes the same ones; each keeps its own)."""
        specs = [TableSpec(rows=e.num_embeddings, dim=e.embedding_dim, name=str(i))
                 for i, e in enumerate(embeddings)]
        dtype = embeddings[0].weight.dtype if embeddings else torch.float32

        def copy(index: int, weight: torch.Tensor, first: int, column: int) -> None:
            weight.copy_(embeddings[index].weight[first: first + weight.shape[0],
                                                  column: column + weight.shape[1]])
        return cls(specs, distribution, plan=plan, dtype=dtype, init=copy)

    def held(self) -> list[int]:
        """The indices of the tables this rank holds."""
        return self.plan.tables_of(self.comm.rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != len(self.tables):
            raise ValueError(f"EmbeddingCollection: expected ids of shape (batch, "
                             f"{len(self.tables)}), got {tuple(ids.shape)}")
        rec = self.exchange_recorder
        size = torch.tensor([ids.shape[0]], dtype=torch.int64, device=ids.device)
        batches = rec.run(size, lambda: collectives.allgather(self.comm, size).wait()).tolist()
        route = _Route(self.comm, self.plan, batches, self.divisor, rec)
        columns = [ids[:, held].reshape(-1) for held in route.held]
        recv = [b * len(route.mine) for b in batches]
        sent = torch.cat(columns)
        mine = rec.run(sent, lambda: collectives.alltoallv(
            self.comm, sent, [c.numel() for c in columns], recv).wait())
        mine = mine.view(sum(batches), len(route.mine))
        looked = (torch.stack([self._lookup(t, mine[:, j]) for j, t in enumerate(route.mine)],
                              dim=1)
                  if route.mine else torch.zeros(sum(batches), 0, self.dim, dtype=self.dtype,
                                       device=ids.device))
        return _Results.apply(looked, route)

    def _lookup(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        weight = self.get_submodule(str(table)).weight
        if self.plan.owners[table] == COLUMN_WISE:  # my columns, zeros elsewhere: summed later
            column, width = self.plan.cols_of(table, self.comm.rank)
            if width == 0:
                return weight.new_zeros(ids.shape[0], self.dim)
            looked = F.embedding(ids, weight, sparse=True)
            return F.pad(looked, (column, self.dim - column - width))
        if self.plan.owners[table] != ROW_WISE:
            return F.embedding(ids, weight, sparse=True)
        first, count = self.plan.rows_of(table, self.comm.rank)
        outside = (ids < first) | (ids >= first + count)
        if count == 0:
            return weight.new_zeros(ids.shape[0], self.dim)
        local = torch.where(outside, torch.zeros_like(ids), ids - first)
        return F.embedding(local, weight, sparse=True).masked_fill(outside.unsqueeze(1), 0.0)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every table's weight on every rank (a broadcast from each owner, an allgatherv of
        a row-wise table's blocks), keyed ``"<t>.weight"`` like an ``nn.ModuleList`` of
        ``nn.Embedding``."""
        out = {}
        for t, (spec, owner) in enumerate(zip(self.tables, self.plan.owners)):
            if owner in (ROW_WISE, COLUMN_WISE):
                mine = self.get_submodule(str(t)).weight.detach()
                if owner == COLUMN_WISE:  # gather the columns as rows of the transpose
                    counts = [self.plan.cols_of(t, r)[1] for r in range(self.comm.size)]
                    gathered = collectives.allgatherv(self.comm, mine.t().contiguous(),
                                                      counts).wait()
                    out[f"{t}.weight"] = gathered.t().contiguous()
                else:
                    counts = [self.plan.rows_of(t, r)[1] for r in range(self.comm.size)]
                    out[f"{t}.weight"] = collectives.allgatherv(self.comm, mine, counts).wait()
                continue
            if owner == self.comm.rank:
                buffer = self.get_submodule(str(t)).weight.detach().clone()
            else:
                buffer = torch.empty(spec.rows, spec.dim, dtype=self.dtype)
            out[f"{t}.weight"] = collectives.bcast(self.comm, buffer, owner).wait()
        return out

    def load_full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of full tables keyed ``"<t>.weight"`` (what :meth:`full_state`
        returns), ready for ``load_state_dict``: the tables it holds, its rows of row-wise
        ones."""
        mine = {}
        for t in self.held():
            first, count = self.plan.rows_of(t, self.comm.rank)
            column, width = self.plan.cols_of(t, self.comm.rank)
            mine[f"{t}.weight"] = state[f"{t}.weight"][first: first + count,
                                                       column: column + width]
        return mine

    def extra_repr(self) -> str:
        return f"{len(self.tables)} tables x {self.dim}, holding {self.held()}"


def _dlrm_init(spec: TableSpec, index: int, weight: torch.Tensor, first: int,
               column: int) -> None:
    """DLRM's init of table ``index``'s block at ``(first, column)`` (drawn whole once)."""
    generator = torch.Generator().manual_seed(0x5EED + index)
    bound = spec.rows ** -0.5
    full = torch.rand(spec.rows, spec.dim, generator=generator, dtype=weight.dtype)
    block = full[first: first + weight.shape[0], column: column + weight.shape[1]]
    weight.copy_(block.mul_(2 * bound).sub_(bound))
