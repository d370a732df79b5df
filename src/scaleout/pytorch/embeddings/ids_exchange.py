"""One batch's ids on their way to the tables' holders (steps 1-3 of the collection's forward).

An :class:`IdsExchange` is built from a ``(B, T)`` batch of ids and runs in three steps,
each started without blocking so that :meth:`EmbeddingCollection.prefetch
<scaleout.pytorch.EmbeddingCollection.prefetch>` can let them travel while an earlier
batch computes:

1. routing (local): each table's distinct ids (one ``torch.unique`` over all tables, the
   ids offset by their table's first row in one id space), the send buffer grouped by holder
   (a row- or column-wise table's ids go to every rank), and for every ``(sample, table)``
   where its row will be in the buffer of rows that comes back;
2. counts: an alltoallv tells each holder how many distinct ids of each of its tables to
   expect;
3. ids: once the counts are there (:meth:`advance`), an alltoallv sends the ids themselves.

With a ``capacity`` (the collection's ``max_batch``), steps 2 and 3 are one alltoallv: each
holder gets a block of a size it knows in advance, its tables' counts followed by the ids,
padded to the most distinct ids a batch of ``max_batch`` samples can send it
(:func:`id_capacity`). One collective fewer per batch; on two ranks sharing a 2-core
machine each costs ~0.5-1 ms whatever its size (benchmarks/RESULTS.md, issue 14, stop 19).
A prefetched batch's blocks may also wait for the next exchange of rows' gradients and
travel in it (:mod:`~scaleout.pytorch.embeddings.ride`, the collection's
``ids_with_gradients``): none of their own then.

Ids do not depend on the weights, so exchanging them early is exact whatever the tables
hold by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started

if TYPE_CHECKING:
    from scaleout.pytorch.embeddings.ride import Ride

__all__ = ["IdsExchange", "Received", "check_ids", "check_ids_with_gradients",
           "check_max_batch", "check_rows", "id_capacity"]


@dataclass(frozen=True)
class Received:
    """What a holder got: ``ids`` of its tables requested by every rank, side by side
    (rank by rank, each rank's in the order of my tables), ``asked[rank, j]`` of them for my
    ``j``-th table."""

    ids: torch.Tensor
    asked: torch.Tensor


class IdsExchange:
    """Routes a batch's ids to the tables' holders (see the module docstring).

    Args:
        ids: ``(B, T)`` int64, column ``t`` indexing table ``t``.
        held: ``held[r]``: the tables rank ``r`` holds (a block of, for split tables).
        first_rows: ``(T,)`` int64, table ``t``'s first row in one id space over all tables
            (the cumulative row counts).
        comm: the data group's communicator.
        recorder: records the exchanges' time (exposed: the waits) and bytes.
        capacity: ``capacity[r]``: the most ids this batch can send rank ``r``
            (:func:`id_capacity`, the same on every rank): counts and ids in one round;
            ``None``: two rounds.
    """

    def __init__(self, ids: torch.Tensor, held: list[list[int]], first_rows: torch.Tensor,
                 comm: Communicator, recorder: ExchangeRecorder,
                 capacity: list[int] | None = None) -> None:
        self.ids = ids
        self.comm, self.recorder = comm, recorder
        self.held, self.capacity = held, capacity
        batch, tables = ids.shape
        # (table, slot): every holder's tables in order; a split table has one slot per rank
        slot_tables = torch.tensor([t for part in held for t in part], dtype=torch.int64,
                                   device=ids.device)
        distinct, inverse = torch.unique((ids + first_rows).reshape(-1), return_inverse=True)
        table_of = torch.bucketize(distinct, first_rows, right=True) - 1
        per_table = torch.bincount(table_of, minlength=tables)
        table_start = torch.cumsum(per_table, 0) - per_table  # in ``distinct``
        slot_counts = per_table[slot_tables]
        slot_start = torch.cumsum(slot_counts, 0) - slot_counts  # in the send buffer
        # the send buffer: each slot's table segment of ``distinct``, as ids of that table
        counts = slot_counts.tolist()
        total = sum(counts)
        order = torch.repeat_interleave(table_start[slot_tables] - slot_start, slot_counts,
                                        output_size=total)
        order += torch.arange(total, device=ids.device)
        self.sent = (distinct - first_rows[table_of])[order]
        self.counts = slot_counts
        self.send = [sum(counts[a:b]) for a, b in _bounds(held)]
        # where the row of sample b's id in slot s's table comes back: (B, slots)
        slot_of = inverse.view(batch, tables)[:, slot_tables]
        self.positions = slot_of - table_start[slot_tables] + slot_start
        self.slot_tables = slot_tables
        if slot_tables.numel() == tables:  # one slot per table (none split): table order
            by_table = torch.empty_like(slot_tables)
            by_table[slot_tables] = torch.arange(tables, device=ids.device)
            self.positions = self.positions[:, by_table]
        #: whether every table has one slot (no row- or column-wise split tables)
        self.whole = slot_tables.numel() == tables
        self._counts: Started | None = None
        self._ids: Started | None = None
        self._asked: torch.Tensor | None = None
        self._padded: torch.Tensor | None = None  # the one round's send buffer
        self._received: Received | None = None
        #: the ids wait for the next exchange of rows' gradients to carry them
        #: (:class:`~scaleout.pytorch.embeddings.ride.Ride`) instead of starting on their own
        self.rides = False
        self._ride: Ride | None = None

    def start(self) -> IdsExchange:
        """Start the counts' exchange (step 2; with a capacity, steps 2 and 3 at once);
        returns ``self``."""
        if self._counts is not None or self._ids is not None or self._received is not None:
            return self
        mine = len(self.held[self.comm.rank])
        if self.capacity is None:
            self._counts = self.recorder.start(collectives.alltoallv(
                self.comm, self.counts, [len(h) for h in self.held], [mine] * self.comm.size))
            return self
        send, blocks, block_in = self.padded()
        self._ids = self.recorder.start(collectives.alltoallv(
            self.comm, send, blocks, [block_in] * self.comm.size))
        self._padded = send
        return self

    def padded(self) -> tuple[torch.Tensor, list[int], int]:
        """The one round's send buffer (with a capacity): each holder's block holds its
        tables' counts, then the ids, then padding; the blocks' sizes; and the size of the
        block this rank gets from every rank."""
        assert self.capacity is not None
        blocks = [len(h) + c for h, c in zip(self.held, self.capacity)]
        send = self.sent.new_zeros(sum(blocks))
        at = offset = 0
        for rank, ((first, end), sent, cap) in enumerate(zip(_bounds(self.held), self.send,
                                                              self.capacity)):
            if sent > cap:  # (the collection checks the batch against max_batch first)
                raise ValueError(f"IdsExchange: {sent} distinct ids for rank {rank}, more than "
                                 f"the {cap} its block holds")
            tables = end - first
            send[at: at + tables] = self.counts[first:end]
            send[at + tables: at + tables + sent] = self.sent[offset: offset + sent]
            at, offset = at + tables + cap, offset + sent
        return send, blocks, blocks[self.comm.rank]

    def join(self, ride: Ride) -> None:
        """Let ``ride`` (an exchange of rows' gradients) carry this batch's ids: the
        collection's ``ids_with_gradients``; :meth:`received` then waits for it."""
        self._ride = ride

    @property
    def carried(self) -> bool:
        """Whether a gradients' exchange carries these ids (:meth:`join`)."""
        return self._ride is not None

    def advance(self) -> None:
        """Wait for the counts and start the ids' exchange (step 3), once (not while the
        ids wait for a gradients' exchange to carry them)."""
        if self.rides:
            return
        self.start()
        if self._ids is not None or self._received is not None:
            return
        assert self._counts is not None
        got = self.recorder.wait(self._counts, self.counts)
        self._asked = got.view(self.comm.size, len(self.held[self.comm.rank]))
        self._ids = self.recorder.start(collectives.alltoallv(
            self.comm, self.sent, self.send, self._asked.sum(dim=1).tolist()))

    def received(self) -> Received:
        """The ids the other ranks asked this rank for (waits for every step; ids waiting
        for a gradients' exchange that none started go on their own now)."""
        if self._received is None and self._ride is not None:
            self._arrive(self._ride.ids())
        elif self._received is None:
            self.rides = False
            self.advance()
            assert self._ids is not None
            if self.capacity is None:
                assert self._asked is not None
                ids = self.recorder.wait(self._ids, self.sent)
                self._received = Received(ids=ids, asked=self._asked)
            else:
                assert self._padded is not None
                self._arrive(self.recorder.wait(self._ids, self._padded))
            self._ids = None
        assert self._received is not None
        return self._received

    def _arrive(self, got: torch.Tensor) -> None:
        """The one round's blocks arrived: each rank's holds my tables' counts, then that
        many ids, then padding."""
        assert self.capacity is not None
        mine = len(self.held[self.comm.rank])
        block = mine + self.capacity[self.comm.rank]
        got = got.to(self.sent.device).view(self.comm.size, block)
        self._asked = got[:, :mine].contiguous()
        ids = torch.cat([got[r, mine: mine + n] for r, n
                         in enumerate(self._asked.sum(dim=1).tolist())])
        self._received = Received(ids=ids, asked=self._asked)

    @property
    def recv(self) -> list[int]:
        """Ids (= rows) received from each rank (after :meth:`received`)."""
        return self.received().asked.sum(dim=1).tolist()

    def gather(self, rows: torch.Tensor, dim: int) -> torch.Tensor:
        """Every sample's ``(T, dim)`` vectors from ``rows`` (one per sent id, in the send
        buffer's order), the blocks of a split table summed."""
        batch, tables = self.ids.shape
        if self.whole:  # positions are in table order: one gather
            return rows.index_select(0, self.positions.reshape(-1)).view(batch, tables, dim)
        per_slot = rows.index_select(0, self.positions.reshape(-1)).view(
            batch, self.slot_tables.numel(), dim)  # (not -1: a batch may be empty)
        return rows.new_zeros(batch, tables, dim).index_add(1, self.slot_tables, per_slot)


def _bounds(held: list[list[int]]) -> list[tuple[int, int]]:
    """``(first, end)`` slot of each rank's tables."""
    out, first = [], 0
    for part in held:
        out.append((first, first + len(part)))
        first += len(part)
    return out


def id_capacity(held: list[list[int]], rows: list[int], max_batch: int) -> list[int]:
    """Per rank, the most distinct ids a batch of ``max_batch`` samples sends it: for each
    table (or block) it holds, that table's ids, of which at most ``min(max_batch, rows)``
    differ (a split table's holders each get all of them)."""
    return [sum(min(max_batch, rows[t]) for t in part) for part in held]


def check_max_batch(max_batch: object) -> None:
    """``max_batch`` is ``None`` or an int >= 1 (else TypeError / ValueError)."""
    if max_batch is None:
        return
    if isinstance(max_batch, bool) or not isinstance(max_batch, int):
        raise TypeError(f"EmbeddingCollection: max_batch must be an int or None, got "
                        f"{type(max_batch).__name__}")
    if max_batch < 1:
        raise ValueError(f"EmbeddingCollection: max_batch must be >= 1, got {max_batch}")


def check_ids_with_gradients(ids_with_gradients: object, max_batch: int | None) -> None:
    """``ids_with_gradients`` is a bool, and needs ``max_batch`` (the ids' blocks must be of a
    size every rank knows in advance to travel inside the gradients' exchange)."""
    if not isinstance(ids_with_gradients, bool):
        raise TypeError(f"EmbeddingCollection: ids_with_gradients must be a bool, got "
                        f"{type(ids_with_gradients).__name__}")
    if ids_with_gradients and max_batch is None:
        raise ValueError("EmbeddingCollection: ids_with_gradients needs max_batch (the ids "
                         "travel in blocks of a size known in advance)")


def check_ids(ids: torch.Tensor, tables: int, max_batch: int | None, what: str) -> None:
    """``ids``: an integer ``(batch, tables)`` tensor of at most ``max_batch`` samples."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: expected an int64 (or int32) tensor of ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != 2 or ids.shape[1] != tables:
        raise ValueError(f"{what}: expected ids of shape (batch, {tables}), got "
                         f"{tuple(ids.shape)}")
    if max_batch is not None and ids.shape[0] > max_batch:
        raise ValueError(f"{what}: a batch of {ids.shape[0]} samples, more than "
                         f"max_batch={max_batch}")


def check_rows(ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Every id of column ``t`` in ``[0, rows[t])``: one past its table would land in the
    next table's rows in the exchange's single id space."""
    outside = ((ids < 0) | (ids >= rows)).any(dim=0)
    if bool(outside.any()):
        t = int(outside.nonzero()[0])
        raise ValueError(f"EmbeddingCollection: ids of table {t} must be in [0, "
                         f"{int(rows[t])}), got {ids[:, t].min().item()}.."
                         f"{ids[:, t].max().item()}")
