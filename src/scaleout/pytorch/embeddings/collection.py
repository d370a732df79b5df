"""EmbeddingCollection: many tables sharded across the data group (DLRM / TorchRec).

Forward, on every rank of the data group (each with its own samples):

1. distinct ids: each table's column of ids is reduced to its distinct ids (ids repeat: a
   batch of 256 Zipf-distributed DLRM samples has 2,077 distinct (table, id) pairs of 6,656);
2. counts, then ids: an alltoallv tells each holder how many distinct ids of each of its
   tables to expect, a second one sends them (a row- or column-wise table's to every holder)
   (steps 1-2: :mod:`~scaleout.pytorch.embeddings.ids_exchange`; :meth:`~EmbeddingCollection.
   prefetch` starts them for a later batch, so that its forward waits only for step 4);
3. lookup: each holder looks every requested id up once (a row-wise table: the ids in its
   block of rows, zeros for the others; a column-wise one: its columns, zeros elsewhere;
   :mod:`~scaleout.pytorch.embeddings.lookup`);
4. rows: an alltoallv sends the rows back; each sample takes its vector from its table's
   distinct rows, and the blocks of row- and column-wise tables are summed (MLSL's
   model-parallel -> data-parallel transition, an all-to-all).

Backward is the reverse of step 4: the gradients of a row's samples are summed by the rank
that asked for it before they travel (with ``ids_with_gradients``, together with the next
prefetched batch's ids: :mod:`~scaleout.pytorch.embeddings.ride`), and reach the table
weights as sparse row gradients, scaled like DataParallel's average over the data group;
the tables are then updated by a row-wise optimizer (``RowWiseAdagrad``, or torch's SGD /
Adagrad / SparseAdam, which accept sparse gradients), or in backward itself
(:meth:`~EmbeddingCollection.update_in_backward`: one update of all of a rank's tables, no
sparse gradients). The dense layers around stay data parallel. With :meth:`~EmbeddingCollection.defer_backward` the reverse exchange does
not block backward: it travels while the dense layers' backward and allreduce run, and
lands (the sparse gradients are written) before the tables' optimizer steps.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from scaleout.core.consistency import verify_plan
from scaleout.core.distribution import Distribution
from scaleout.core.env import attach
from scaleout.core.grid import GroupType
from scaleout.pytorch.embeddings.batched import TableBatch
from scaleout.pytorch.embeddings.full_state import gather_full_state, part_of_full_state
from scaleout.pytorch.embeddings.ids_exchange import (
    IdsExchange,
    check_ids,
    check_ids_with_gradients,
    check_max_batch,
    check_rows,
    id_capacity,
)
from scaleout.pytorch.embeddings.lookahead import Lookahead
from scaleout.pytorch.embeddings.lookup import look_up
from scaleout.pytorch.embeddings.planner import (
    COLUMN_WISE,
    ShardingPlan,
    TableSpec,
    plan_tables,
)
from scaleout.pytorch.embeddings.rows_exchange import Landing, exchange_rows
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started
from scaleout.pytorch.placement import Kind, Placement, place

__all__ = ["EmbeddingCollection"]


class EmbeddingCollection(Lookahead):
    """Embedding tables sharded across the data group; ``(B, T)`` ids -> ``(B, T, dim)``.

    Column ``t`` of the ids indexes table ``t`` (one id per table per sample, as in DLRM).
    Each rank holds only its tables (whole, or its block of rows of a ``ROW_WISE`` table, or
    of columns of a ``COLUMN_WISE`` one),
    registered as submodules named by the table index (``"3"``), so an owner's state dict
    has the keys of an ``nn.ModuleList`` of ``nn.Embedding``; :meth:`full_state` gathers
    every table on every rank. :meth:`prefetch` (or the :func:`prefetching` loader wrapper)
    and :meth:`start_lookup` (or :meth:`look_up_after`) send a later batch's ids and rows
    ahead of its forward, and :meth:`defer_backward` lets the rows' gradients travel while
    the rest of backward runs, with the same results.

    Args:
        tables: the tables (all with one ``dim``).
        distribution: the grid; tables are spread over its DATA group (each rank of a model
            group holds the same ones); ``None``: every rank of an initialised job.
        plan: who holds what; default :func:`plan_tables` (balanced, unlimited memory).
        dtype: weight dtype.
        init: ``init(table_index, weight, first_row, first_column)`` fills this rank's block
            of a table in place (default: DLRM's uniform +-rows^-0.5 from a generator seeded
            by the table index, the same values whichever rank holds them).
        max_batch: the most samples a rank passes to one forward or prefetch; given, a
            batch's id counts and ids travel in one round (blocks padded for it) instead of
            two. The same on every rank.
        ids_with_gradients: a prefetched batch's ids wait for the next backward and travel
            with the rows' gradients, in one exchange (one collective fewer per batch); a
            forward or lookup that needs them before any backward sends them alone. Needs
            ``max_batch``. The same on every rank.

    Raises:
        ValueError: tables of different widths, a plan for other tables or ranks, a
            ``max_batch`` < 1, ``ids_with_gradients`` without ``max_batch``, or ranks of the
            data group with different tables, dtypes, plans, ``max_batch`` or
            ``ids_with_gradients`` (every rank raises).

    Example (2 ranks; rank 0 holds tables 0 and 3, rank 1 tables 1 and 2):
        >>> ec = EmbeddingCollection([TableSpec(rows=r, dim=8) for r in (9, 5, 4, 2)], dist)
        >>> ec(torch.zeros(6, 4, dtype=torch.long)).shape   # this rank's 6 samples
        torch.Size([6, 4, 8])
    """

    def __init__(self, tables: Sequence[TableSpec], distribution: Distribution | None = None, *,
                 plan: ShardingPlan | None = None, dtype: torch.dtype = torch.float32,
                 init: Any = None, max_batch: int | None = None,
                 ids_with_gradients: bool = False) -> None:
        super().__init__()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"EmbeddingCollection: dtype must be a floating torch dtype, got "
                            f"{dtype!r}")
        check_max_batch(max_batch)
        check_ids_with_gradients(ids_with_gradients, max_batch)
        tables = tables if isinstance(tables, TableSpec) else tuple(tables)
        if isinstance(tables, TableSpec) or not all(isinstance(t, TableSpec) for t in tables):
            raise TypeError(f"EmbeddingCollection: tables must be a sequence of TableSpec, got "
                            f"{tables!r}"[:200])
        if not tables:
            raise ValueError("EmbeddingCollection needs at least one table")
        if distribution is None:  # (after the checks that need no process group)
            distribution = attach().create_distribution()
        if not isinstance(distribution, Distribution):
            raise TypeError(f"EmbeddingCollection: distribution must be a scaleout.Distribution "
                            f"or None, got {type(distribution).__name__}")
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
        # every rank routes ids by its own plan: plans that differ would answer ids with
        # another table's rows
        verify_plan(self.comm, "EmbeddingCollection plan", f"tables {shapes} of {dtype}, "
                    f"owners {self.plan.owners}, max_batch {max_batch}, ids with gradients "
                    f"{ids_with_gradients}")
        self.tables = tables
        self.exchange_recorder = ExchangeRecorder()
        self.dim = dims.pop()
        self.dtype, self.device = dtype, torch.device("cpu")  # the tables' (see _apply)
        self._rows = torch.tensor([t.rows for t in tables], dtype=torch.int64)
        self._first_rows = torch.cumsum(self._rows, 0) - self._rows  # t's ids in one id space
        self._rows_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (_exchange)
        self.max_batch, self.ids_with_gradients = max_batch, ids_with_gradients
        self._held = [self.plan.tables_of(r) for r in range(self.comm.size)]  # by every rank
        self._capacity = None if max_batch is None else id_capacity(
            self._held, self._rows.tolist(), max_batch)
        self._pending: deque[IdsExchange] = deque()  # prefetched, oldest first
        # id(exchange): its rows (in the tables' autograd graph) on their way
        self._started: dict[int, tuple[torch.Tensor, Started]] = {}
        self._landing = Landing(self.divisor, self.exchange_recorder)  # defer_backward's
        # look_up_after_backward's handles (an OrderedDict: RemovableHandle keeps a weakref)
        self._after_backward: OrderedDict[int, bool] = OrderedDict()
        mine = self.plan.tables_of(self.comm.rank)
        # my tables' rows in one weight (the column-wise blocks apart)
        self._batch = TableBatch([None if self.plan.owners[t] == COLUMN_WISE
                                  else self.plan.rows_of(t, self.comm.rank) for t in mine],
                                 [tables[t].rows for t in mine], self.dim, dtype)
        for j, t in enumerate(mine):
            first, count = self.plan.rows_of(t, self.comm.rank)
            column, width = self.plan.cols_of(t, self.comm.rank)
            table = nn.Embedding(max(count, 1), max(width, 1), sparse=True, dtype=dtype)
            if self.plan.owners[t] == COLUMN_WISE:
                table.weight.data = table.weight.data[:count, :width]  # may hold nothing
            else:  # a view of the batched weight
                table.weight.data = self._batch.view(j)
            with torch.no_grad():
                if init is not None:
                    init(t, table.weight, first, column)
                else:
                    _dlrm_init(tables[t], t, table.weight, first, column)
            place(table.weight, Placement(kind=Kind.LOCAL, layer=f"table {t}"))
            self.add_module(str(t), table)
        # (plain references: get_submodule per table and lookup cost ~10 us each)
        self._mine: list[tuple[int, nn.Embedding]] = [(t, getattr(self, str(t))) for t in mine]

    @classmethod
    def from_embeddings(cls, embeddings: Sequence[nn.Embedding],
                        distribution: Distribution | None = None, *,
                        plan: ShardingPlan | None = None, max_batch: int | None = None,
                        ids_with_gradients: bool = False) -> EmbeddingCollection:
        """Shard existing tables (every rank passes the same ones; each keeps its own;
        ``plan``, ``max_batch`` and ``ids_with_gradients`` as for the constructor).

        Tables that are all frozen (``requires_grad`` off, ``nn.Embedding.from_pretrained``'s
        default) give a frozen collection.

        Raises:
            ValueError: a table with ``padding_idx``, ``max_norm`` or ``scale_grad_by_freq``
                (the sharded tables would ignore them), or frozen tables beside trained ones
                (the collection's tables are frozen or trained together; before, a frozen
                table was trained).
        """
        frozen = [i for i, e in enumerate(embeddings) if not e.weight.requires_grad]
        if frozen and len(frozen) < len(embeddings):
            raise ValueError(f"EmbeddingCollection.from_embeddings: tables {frozen} are frozen "
                             f"(requires_grad=False) and the others are not; the collection's "
                             f"tables train together: keep the frozen ones in a collection of "
                             f"their own")
        for i, e in enumerate(embeddings):
            for option, unset in (("padding_idx", None), ("max_norm", None),
                                  ("scale_grad_by_freq", False)):
                if getattr(e, option) != unset:
                    raise ValueError(f"EmbeddingCollection.from_embeddings: table {i}: {option} "
                                     f"= {getattr(e, option)!r} is not supported")
        specs = [TableSpec(rows=e.num_embeddings, dim=e.embedding_dim, name=str(i))
                 for i, e in enumerate(embeddings)]
        dtype = embeddings[0].weight.dtype if embeddings else torch.float32

        def copy(index: int, weight: torch.Tensor, first: int, column: int) -> None:
            weight.copy_(embeddings[index].weight[first: first + weight.shape[0],
                                                  column: column + weight.shape[1]])
        collection = cls(specs, distribution, plan=plan, dtype=dtype, init=copy,
                         max_batch=max_batch, ids_with_gradients=ids_with_gradients)
        return collection.requires_grad_(False) if frozen else collection

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``.double()``, ``.to(device)``: a rank that holds no table follows too (its lookups
        # and receive buffers must be of the holders' dtype and device)
        like = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        self.dtype, self.device = like.dtype, like.device
        return super()._apply(fn, recurse)

    def held(self) -> list[int]:
        """The indices of the tables this rank holds."""
        return self.plan.tables_of(self.comm.rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check(ids, "forward")
        exchange = self._take(ids)
        self.land_gradients()  # (a backward without a step since: its gradients accumulate)
        looked, started = self._started.pop(id(exchange), (None, None))
        if looked is None:
            received = exchange.received()
            looked = self._look_up(received.ids, received.asked)
        rows = exchange_rows(looked, self.comm, exchange.recv, exchange.send, self.divisor,
                             self.exchange_recorder, started,
                             self._landing if self._landing.active else None,
                             self._backward_done if self._after_backward else None,
                             self._rider if self.ids_with_gradients else None)
        self._advance()  # the next batches' ids travel while this one computes
        return exchange.gather(rows, self.dim)

    def _check(self, ids: torch.Tensor, what: str) -> None:
        check_ids(ids, len(self.tables), self.max_batch, f"EmbeddingCollection.{what}")

    def _exchange(self, ids: torch.Tensor) -> IdsExchange:
        """A new exchange of ``ids`` (checked: an id past its table would land in the next
        one's rows in the exchange's single id space)."""
        # (copied to the ids' device once: on a GPU every copy from the host is followed by
        # a stream synchronisation, two per forward before this cache)
        if ids.device not in self._rows_on:
            self._rows_on[ids.device] = (self._rows.to(ids.device),
                                         self._first_rows.to(ids.device))
        rows, first_rows = self._rows_on[ids.device]
        check_rows(ids, rows)
        return IdsExchange(ids.long(), self._held, first_rows, self.comm,
                           self.exchange_recorder, self._capacity)

    def _look_up(self, ids: torch.Tensor, asked: torch.Tensor) -> torch.Tensor:
        weights = {t: table.weight for t, table in self._mine}
        return look_up(self._batch, weights, self.plan, self.comm.rank, ids, asked, self.dtype)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every table's weight on every rank, keyed ``"<t>.weight"`` like an
        ``nn.ModuleList`` of ``nn.Embedding`` (``embeddings.full_state``)."""
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        return gather_full_state(self.comm, self.plan, self.tables,
                                 lambda t: self.get_submodule(str(t)).weight, like)

    def load_full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of full tables keyed ``"<t>.weight"`` (what :meth:`full_state`
        returns), ready for ``load_state_dict`` (``embeddings.full_state``).

        Raises:
            ValueError: a table it holds is not of its full ``(rows, dim)`` shape.
        """
        part = part_of_full_state(self.plan, self.tables, self.held(), self.comm.rank, state)
        return {**part, "_extra_state": self.get_extra_state()}  # (the rule's state: kept)

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
