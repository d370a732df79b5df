"""Row-sparse exact exchange: only the rows some rank touched go on the wire.

An embedding's gradient (``nn.Embedding``, ``nn.EmbeddingBag``, a transformer's token
table, DLRM's tables) is zero outside the rows the batch looked up. This codec is
lossless: round 1 allreduces, per matrix, a flag per row (non-zero anywhere on this
rank), so every rank learns the same union of touched rows; round 2 allreduces those
rows only, and tensors without rows to skip (1-D tensors, or matrices where more than
``dense_above`` of the rows were touched) whole. The sum equals a dense allreduce's:
untouched rows are zero on every rank. NaN/Inf make their row touched and propagate
as in a dense allreduce.
"""

from __future__ import annotations

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
from scaleout.compression.state import CodecState
from scaleout.core import collectives

__all__ = ["RowsCodec"]


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
        """Round 1: row flags of every matrix; round 2: the union's rows and the rest whole."""
        check_compressible(self.name, flat)
        if flat.numel() == 0:
            return flat.clone()
        layout = bucket_layout(shapes)
        # (an empty tensor goes "whole": it shares its offset with the next, which keys union)
        matrices = [(o, n, s) for o, n, s in layout if len(s) >= 2 and s[0] > 1 and n > 0]
        flags = [_touched(_as_rows(flat[o:o + n], s)).to(flat.dtype) for o, n, s in matrices]
        union: dict[int, torch.Tensor] = {}
        if flags:
            summed = yield collectives.allreduce(comm, torch.cat(flags))
            at = 0
            for o, n, s in matrices:
                rows = summed[at:at + s[0]].ne(0).nonzero().view(-1)  # host sync: round 2's size
                at += s[0]
                if rows.numel() <= self.dense_above * s[0]:
                    union[o] = rows
        pieces = [_as_rows(flat[o:o + n], s)[union[o]].reshape(-1) if o in union
                  else flat[o:o + n] for o, n, s in layout]
        summed = yield collectives.allreduce(comm, torch.cat(pieces))
        result = state.work_buffer("result", flat.numel(), flat.dtype, device=flat.device)
        at = 0
        for (o, n, s), piece in zip(layout, pieces):
            part = summed[at:at + piece.numel()]
            at += piece.numel()
            if o in union:
                target = _as_rows(result[o:o + n].zero_(), s)
                target.index_copy_(0, union[o], part.view(union[o].numel(), target.shape[1]))
            else:
                result[o:o + n].copy_(part)
        return result


def _as_rows(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``flat`` as ``(rows, values per row)``: ``shape[0]`` rows for 2+ dims, else one row
    (sizes explicit: a tensor with no elements has no ``-1`` to infer)."""
    if len(shape) >= 2 and shape[0] > 0:
        return flat.view(shape[0], flat.numel() // shape[0])
    return flat.view(1, flat.numel())


def _touched(matrix: torch.Tensor) -> torch.Tensor:
    """Per row: holds a non-zero (NaN and Inf count)."""
    return matrix.ne(0).any(dim=1)
