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

Ids do not depend on the weights, so exchanging them early is exact whatever the tables
hold by then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started

__all__ = ["IdsExchange", "Received"]


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
    """

    def __init__(self, ids: torch.Tensor, held: list[list[int]], first_rows: torch.Tensor,
                 comm: Communicator, recorder: ExchangeRecorder) -> None:
        self.ids = ids
        self.comm, self.recorder = comm, recorder
        self.held = held
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
        self._received: Received | None = None

    def start(self) -> IdsExchange:
        """Start the counts' exchange (step 2); returns ``self``."""
        if self._counts is None:
            mine = len(self.held[self.comm.rank])
            self._counts = self.recorder.start(collectives.alltoallv(
                self.comm, self.counts, [len(h) for h in self.held], [mine] * self.comm.size))
        return self

    def advance(self) -> None:
        """Wait for the counts and start the ids' exchange (step 3), once."""
        self.start()
        if self._ids is not None or self._received is not None:
            return
        assert self._counts is not None
        got = self.recorder.wait(self._counts, self.counts)
        self._asked = got.view(self.comm.size, len(self.held[self.comm.rank]))
        self._ids = self.recorder.start(collectives.alltoallv(
            self.comm, self.sent, self.send, self._asked.sum(dim=1).tolist()))

    def received(self) -> Received:
        """The ids the other ranks asked this rank for (waits for every step)."""
        if self._received is None:
            self.advance()
            assert self._ids is not None and self._asked is not None
            ids = self.recorder.wait(self._ids, self.sent)
            self._received = Received(ids=ids, asked=self._asked)
            self._ids = None
        return self._received

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
