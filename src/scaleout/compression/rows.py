"""Row-sparse exact exchange: only the rows some rank touched go on the wire.

An embedding's gradient (``nn.Embedding``, ``nn.EmbeddingBag``, a transformer's token
table, DLRM's tables) is zero outside the rows the batch looked up. This codec is
lossless: round 1 exchanges, per matrix, a flag per row (non-zero anywhere on this rank),
so every rank learns the same union of touched rows; round 2 allreduces those rows only,
and tensors without rows to skip (1-D tensors, or matrices where more than ``dense_above``
of the rows were touched) whole. The sum equals
a dense allreduce's: untouched rows are zero on every rank. NaN/Inf make their row
touched and propagate as in a dense allreduce.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from scaleout.compression.base import (
    Codec,
    Communicator,
    ExchangeGenerator,
    TensorMeta,
    bucket_layout,
    check_compressible,
    check_number,
)
from scaleout.compression.bits import pack_bits, unpack_bits
from scaleout.compression.state import CodecState
from scaleout.core import collectives
from scaleout.core.collectives import ReduceOp

__all__ = ["ROWS_HINT_MISSED", "ROWS_HINT_PROVEN", "ROWS_SEARCH", "ROWS_TOUCHED", "RowsCodec"]


@dataclass(frozen=True, kw_only=True)
class RowsCodec(Codec):
    """Lossless: send the union of the rows any rank touched (tolerance: float summation order).

    A tensor of shape ``(R, ...)`` with at least 2 dimensions is ``R`` rows of
    ``numel / R`` values; other tensors go whole. Two rounds (row flags, then rows).

    Args:
        dense_above: if more than this share of a matrix's rows were touched by some rank,
            it goes whole (gathering rows would cost more than it saves).

    Raises:
        ValueError: If ``dense_above`` is not in ``[0, 1]``.

    Example:
        >>> codec = RowsCodec()
        >>> g = torch.zeros(4, 2); g[2] = 1.0
        >>> payload, ctx = codec.encode(g, CodecState())
        >>> payload[1].tolist(), torch.equal(codec.decode(payload, ctx), g)
        ([2], True)
    """

    name: ClassVar[str] = "rows"
    summable: ClassVar[bool] = False
    rounds: ClassVar[int] = 2

    dense_above: float = 0.5

    def __post_init__(self) -> None:
        check_number("rows", "dense_above", self.dense_above)
        if not 0.0 <= float(self.dense_above) <= 1.0:
            raise ValueError(f"rows: dense_above must be in [0, 1], got {self.dense_above!r}")

    def encode(self, tensor: torch.Tensor, state: CodecState) -> tuple[list[torch.Tensor], TensorMeta]:
        """This rank's touched rows; see :meth:`Codec.encode`.

        Returns:
            ``([rows flat, row indices int32], meta)``; a tensor that is not a matrix is
            one row.
        """
        check_compressible(self.name, tensor)
        matrix = _as_rows(tensor.detach().reshape(-1), tuple(tensor.shape))
        touched = _touched(matrix).nonzero().view(-1)  # a host sync: the payload's size
        return ([matrix[touched].reshape(-1), touched.to(torch.int32)],
                TensorMeta(tensor.shape, tensor.dtype))

    def decode(self, payload: Sequence[torch.Tensor], ctx: TensorMeta) -> torch.Tensor:
        """Scatter the rows into zeros; see :meth:`Codec.decode`."""
        values, rows = payload
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=values.device)
        matrix = _as_rows(out, tuple(ctx.shape))
        matrix.index_copy_(0, rows.long(), values.view(rows.numel(), matrix.shape[1]).to(ctx.dtype))
        return out.view(ctx.shape)

    def exchange(
        self, tensor: torch.Tensor, state: CodecState, comm: Communicator
    ) -> ExchangeGenerator:
        """A bucket of one tensor."""
        return self.exchange_bucket(tensor.reshape(-1), [tuple(tensor.shape)], state, comm)

    def exchange_bucket(
        self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]], state: CodecState,
        comm: Communicator,
    ) -> ExchangeGenerator:
        """Round 1: row flags of every matrix; round 2: the union's rows and the rest whole.

        Matrices of one row width back to back (a model's embedding tables) are handled as
        one block of rows: one flag pass, one gather and one scatter for all of them, so
        the host's work per bucket does not grow with the number of tables. A
        :data:`ROWS_TOUCHED` hint in ``state`` stands in for the flag pass, but over the
        rows a :data:`ROWS_SEARCH` entry names.

        Raises:
            ValueError: a :data:`ROWS_TOUCHED` hint that is not one bool per flagged row, or
                a :data:`ROWS_SEARCH` range that is not within one block of matrices."""
        check_compressible(self.name, flat)
        if flat.numel() == 0:
            return flat.clone()
        blocks = _blocks(bucket_layout(shapes))
        matrices = [block for block in blocks if block[2]]
        chosen: dict[int, torch.Tensor] = {}  # block offset -> the rows sent (absent: whole)
        hint = state.scratch.pop(ROWS_TOUCHED, None)  # (for this exchange only)
        search = state.scratch.pop(ROWS_SEARCH, ())
        proven = state.scratch.pop(ROWS_HINT_PROVEN, False)
        if matrices:
            flags = _checked_hint(hint, sum(n // w for _, n, w, _ in matrices), flat.device)
            scratch = None if flags is not None and not search else state.work_buffer(
                "magnitudes", flat.numel(), flat.dtype, device=flat.device)
            if flags is not None:  # the hint's, and a pass over the rows it does not know
                for first, stop, o, w in _searched(search, matrices):
                    flags[first:stop] = _touched(flat[o:o + (stop - first) * w].view(-1, w),
                                                 scratch[o:o + (stop - first) * w].view(-1, w))
                if not proven and not _covered(flat, matrices, flags):  # (a loss term
                    # outside the forward)
                    state.scratch[ROWS_HINT_MISSED] = True
                    flags = None
            if flags is None:  # find them: a pass over every matrix
                scratch = scratch if scratch is not None else state.work_buffer(
                    "magnitudes", flat.numel(), flat.dtype, device=flat.device)
                flags = torch.cat([_touched(flat[o:o + n].view(-1, w),
                                            scratch[o:o + n].view(-1, w))
                                   for o, n, w, _ in matrices])
            if comm.size <= BITS_UP_TO:  # a bit per row, every rank's to every rank: OR
                bits = _packed(flags)
                every = yield collectives.alltoall(comm, bits.repeat(comm.size))
                union = _unpacked(every.view(comm.size, -1), flags.numel())
            else:  # a byte per row, MAX: the union in a ring's bytes
                every = yield collectives.allreduce(comm, flags.to(torch.uint8), ReduceOp.MAX)
                union = every.ne(0)
            chosen = self._rows_to_send(union, matrices)
        pieces = [flat[o:o + n].view(-1, w).index_select(0, chosen[o]).view(-1)
                  if o in chosen else flat[o:o + n] for o, n, w, _ in blocks]
        summed = yield collectives.allreduce(comm, torch.cat(pieces))
        # The sum lands in ``flat`` itself: a row outside the union is zero there already
        # (untouched here), so only the union's rows and the whole tensors are written.
        at = 0
        for (o, n, w, _), piece in zip(blocks, pieces):
            part = summed[at:at + piece.numel()]
            at += piece.numel()
            if o in chosen:
                flat[o:o + n].view(-1, w).index_copy_(0, chosen[o], part.view(-1, w))
            else:
                flat[o:o + n].copy_(part)
        return flat

    @staticmethod
    def row_counts(shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """Per tensor of a bucket of ``shapes``: the rows :meth:`exchange_bucket` flags and
        may skip (0: the tensor goes whole). The flags of a bucket (and a
        :data:`ROWS_TOUCHED` hint) are these tensors' rows, in bucket order."""
        return [_row_count(tuple(shape)) for shape in shapes]

    def _rows_to_send(self, union: torch.Tensor, matrices: list[_Block]
                      ) -> dict[int, torch.Tensor]:
        """Per block of matrices (by offset): the rows some rank touched, where a matrix
        with more than ``dense_above`` of its rows touched sends all of them; a block whose
        every row goes is sent whole (absent). Two host reads per block: the touched rows'
        count, then where each matrix's touched rows end (found in the sorted rows)."""
        chosen, at = {}, 0
        for o, n, w, per_matrix in matrices:
            rows = n // w
            sent = union[at:at + rows].nonzero().view(-1)  # (host sync: round 2's size)
            at += rows
            ends = list(itertools.accumulate(per_matrix))  # each matrix's rows: [end - n, end)
            upto = torch.searchsorted(sent, torch.tensor(ends, device=sent.device)).tolist()
            firsts = [0, *upto[:-1]]  # matrix m's touched rows are sent[firsts[m]:upto[m]]
            dense = [m for m, count in enumerate(per_matrix)
                     if upto[m] - firsts[m] > self.dense_above * count]
            if dense:  # those matrices' rows all go, in order
                pieces, begin = [], 0
                for m in dense:
                    pieces += [sent[begin:firsts[m]],
                               torch.arange(ends[m] - per_matrix[m], ends[m], device=sent.device)]
                    begin = upto[m]
                sent = torch.cat([*pieces, sent[begin:]])
            if sent.numel() < rows:
                chosen[o] = sent
        return chosen


#: The :class:`~scaleout.compression.CodecState` ``scratch`` key under which a caller that
#: knows which rows a batch looked up hands them to the bucket's next
#: :meth:`RowsCodec.exchange_bucket` (which takes it out, so it serves one exchange): a bool
#: per flagged row (:meth:`RowsCodec.row_counts`, bucket order), true at least wherever the
#: gradient row is not zero. The exchange then skips the pass over the matrices that finds
#: them (``scaleout.pytorch.lookup_ids``: DLRM's 5 MB of tables, on the critical path).
ROWS_TOUCHED = "rows_touched"

#: With a :data:`ROWS_TOUCHED` hint, the flagged rows it does not know (``scratch`` key):
#: ``(first, count)`` ranges in flag order, each within one block of matrices (a matrix's
#: rows always are). The exchange searches the gradient for those rows' flags, and takes the
#: hint's for the others: a bucket of tables and other matrices (``rows`` named for every
#: layer) skips the pass over its tables. Taken out with the hint; ignored without one.
ROWS_SEARCH = "rows_search"


#: Set in ``scratch`` beside a :data:`ROWS_TOUCHED` hint by a giver that saw the gradient of
#: each hinted tensor come from the hint's lookups alone (``scaleout.pytorch.lookup_ids``:
#: the tensor a lookup's backward gave, unchanged since but for the other lookups' in-place
#: additions): the exchange then skips its check of the hint (:func:`_covered`). Taken out
#: with the hint.
ROWS_HINT_PROVEN = "rows_hint_proven"

#: Set in ``scratch`` (and kept) when a :data:`ROWS_TOUCHED` hint missed a row whose gradient
#: is not zero: a term of the loss outside the forward the hint came from (an L2 penalty on
#: the table) adds to every row. That exchange searched its rows instead; the hint's giver
#: (``scaleout.pytorch.lookup_ids``) gives no more.
ROWS_HINT_MISSED = "rows_hint_missed"


def _covered(flat: torch.Tensor, matrices: list[_Block], flags: torch.Tensor) -> bool:
    """Whether every non-zero of ``matrices`` lies in a row ``flags`` marks: one count of the
    non-zeros over each block (NaN counts) and one over its flagged rows. A hint is the
    forward's account of the rows; only the gradient can say that nothing else wrote to it,
    and a count is the cheapest pass over it (~0.6 ms for DLRM's 5 MB on one core here,
    against ~0.7 ms for the flags themselves). The host reads the counts (a sync on a GPU,
    where round 2's size needs one anyway)."""
    total, inside, at = [], [], 0
    for o, n, w, _ in matrices:
        rows = n // w
        block = flat[o:o + n].view(-1, w)
        total.append(torch.count_nonzero(block))
        marked = flags[at:at + rows].nonzero().view(-1)
        inside.append(torch.count_nonzero(block.index_select(0, marked)))
        at += rows
    return bool(torch.stack(total).sum() == torch.stack(inside).sum())


def _searched(ranges: Sequence[tuple[int, int]], matrices: list[_Block]
              ) -> list[tuple[int, int, int, int]]:
    """Each :data:`ROWS_SEARCH` range as ``(first flag, stop flag, first element, width)``.

    Raises:
        ValueError: a range that is not within one block of ``matrices``."""
    starts = list(itertools.accumulate((n // w for _, n, w, _ in matrices), initial=0))
    out = []
    for entry in ranges:
        first, count = entry if isinstance(entry, tuple) and len(entry) == 2 else (-1, 0)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (first, count)):
            first, count = -1, 0
        b = next((b for b in range(len(matrices)) if starts[b] <= first < starts[b + 1]), None)
        if b is None or count < 1 or first + count > starts[b + 1]:
            raise ValueError(f"rows: a {ROWS_SEARCH!r} entry must be (first row, rows) within "
                             f"one block of matrices (blocks start at rows {starts}), got "
                             f"{entry!r}")
        o, _, w, _ = matrices[b]
        out.append((first, first + count, o + (first - starts[b]) * w, w))
    return out


def _checked_hint(hint: torch.Tensor | None, rows: int, device: torch.device
                  ) -> torch.Tensor | None:
    """A :data:`ROWS_TOUCHED` hint for ``rows`` flagged rows, on ``device`` (``None``: none).

    Raises:
        ValueError: it is not one bool per flagged row.
    """
    if hint is None:
        return None
    if not isinstance(hint, torch.Tensor) or hint.dtype != torch.bool or hint.numel() != rows:
        got = (f"{hint.numel()} values of {hint.dtype}" if isinstance(hint, torch.Tensor)
               else type(hint).__name__)
        raise ValueError(f"rows: the {ROWS_TOUCHED!r} hint must be one bool per flagged row "
                         f"({rows}), got {got}")
    flags = hint.reshape(-1).to(device)
    if flags.is_cuda:  # written on the compute stream at the forward, read here on the
        # communication stream: its memory must not return to the compute stream's pool
        # before these reads are done (it is freed on this thread once the exchange ends)
        flags.record_stream(torch.cuda.current_stream(flags.device))
    return flags


#: Up to this many ranks the row flags travel as bits, each rank's to every rank (an
#: all-to-all of ``p`` copies), OR-ed on arrival: ``(p - 1) / 8`` bytes per row out of each
#: rank, against a byte-per-row ring all-reduce's ``2 (p - 1) / p``, fewer up to 16 ranks.
#: DLRM's 77,776 rows at 2 ranks: 9.7 KB instead of 78 KB, 5 ms of wire less per iteration
#: at 100 Mbit/s (1.13x faster; within the spread at 1 Gbit/s; RESULTS.md, stop 34).
BITS_UP_TO = 16


def _packed(flags: torch.Tensor) -> torch.Tensor:
    """Boolean ``flags`` as bits (:func:`~scaleout.compression.bits.pack_bits`), the last
    byte zero-padded."""
    padded = torch.zeros(-(-flags.numel() // 8) * 8, dtype=torch.bool, device=flags.device)
    padded[:flags.numel()] = flags
    return pack_bits(padded)


def _unpacked(every: torch.Tensor, count: int) -> torch.Tensor:
    """The OR of the rows of ``every`` (each a :func:`_packed` bit vector), as ``count``
    booleans."""
    union = every[0].clone()
    for other in every[1:]:
        union |= other
    return unpack_bits(union, count)


#: ``(offset, numel, row width, rows of each matrix)``: matrices of one row width back to
#: back, or (width 0) another tensor, sent whole.
_Block = tuple[int, int, int, list[int]]


def _blocks(layout: list[tuple[int, int, tuple[int, ...]]]) -> list[_Block]:
    """The bucket's tensors as blocks: runs of matrices (2+ dimensions, 2+ rows) with one
    row width back to back, and every other non-empty tensor alone (width 0)."""
    blocks: list[_Block] = []
    for o, n, s in layout:
        if n == 0:
            continue
        if not _row_count(s):
            blocks.append((o, n, 0, []))
            continue
        width = n // s[0]
        if blocks and blocks[-1][2] == width and blocks[-1][0] + blocks[-1][1] == o:
            bo, bn, _, per_matrix = blocks[-1]
            blocks[-1] = (bo, bn + n, width, [*per_matrix, s[0]])
        else:
            blocks.append((o, n, width, [s[0]]))
    return blocks


def _row_count(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of ``shape`` that a bucket's exchange flags: a matrix (2+ dims) of
    2+ rows and some values; else 0 (it goes whole)."""
    return shape[0] if len(shape) >= 2 and shape[0] >= 2 and math.prod(shape) else 0


def _as_rows(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``flat`` as ``(rows, values per row)``: ``shape[0]`` rows for 2+ dims, else one row
    (sizes explicit: a tensor with no elements has no ``-1`` to infer)."""
    if len(shape) >= 2 and shape[0] > 0:
        return flat.view(shape[0], flat.numel() // shape[0])
    return flat.view(1, flat.numel())


def _touched(matrix: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Per row: holds a non-zero (NaN and Inf count): the sum of its absolute values is not
    zero (a sum of non-negative values is zero only when each is; NaN and overflow stay
    non-zero). On the CPU ~4x faster than ``ne(0).any(dim=1)``, whose boolean reduction
    over short rows dominated the exchange (DLRM's 26 tables: 2.7 -> 0.7 ms; RESULTS.md,
    stop 33). ``scratch``: a reused buffer of ``matrix``'s shape for the absolute values
    (a fresh one each time costs its page faults)."""
    magnitudes = matrix.abs() if scratch is None else torch.abs(matrix, out=scratch)
    if magnitudes.device.type == "cpu" and magnitudes.dtype in (torch.float32, torch.float64):
        # BLAS's product with ones: the same sums, ~1.5x faster than sum(dim=1) here
        # (x * 1 is exact, and nothing flushes denormals on the CPU unless asked to)
        return torch.mv(magnitudes, magnitudes.new_ones(magnitudes.shape[1])).ne(0)
    return magnitudes.sum(dim=1).ne(0)
