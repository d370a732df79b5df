"""A batch's rows' gradients and a later batch's ids in one alltoallv (``ids_with_gradients``).

Both go the same way, from the ranks that own the samples to the tables' holders: the rows'
gradients at the end of the lookups' backward, and the ids of the next prefetched batch,
which its lookup needs no earlier than that (the tables are updated by those gradients
first). :class:`Ride` sends them in one exchange, one collective fewer per batch than
sending the ids when they are prefetched. On two ranks sharing a 2-core machine each
collective costs ~0.5-1 ms of CPU whatever its size (benchmarks/RESULTS.md, issue 14).

The ids are the collection's one-round blocks (counts, ids, padding to ``max_batch``'s
capacity, :mod:`~scaleout.pytorch.embeddings.ids_exchange`), carried bit for bit in the
gradients' dtype (an int64 is 8 bytes: 2 float32 words, 1 float64, 4 bfloat16); an
all-to-all moves bytes and never computes on them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.exchange_stats import ExchangeRecorder

__all__ = ["Carried", "Ride", "can_carry"]

ID_BYTES = 8  # int64


def can_carry(grad: torch.Tensor) -> bool:
    """Whether int64 ids fit a whole number of ``grad``'s elements."""
    return ID_BYTES % grad.element_size() == 0


class Carried(Protocol):
    """Ids that can travel in a :class:`Ride` (an
    :class:`~scaleout.pytorch.embeddings.ids_exchange.IdsExchange` with a capacity)."""

    def padded(self) -> tuple[torch.Tensor, list[int], int]:
        """The one-round send buffer, its blocks' sizes, the size of each block received."""

    def join(self, ride: Ride) -> None:
        """``ride`` carries these ids."""


class Ride:
    """Starts one alltoallv of ``grad`` (``grad_send[j]`` rows for rank ``j``, ``grad_recv[i]``
    rows coming from rank ``i``) and of ``ids``' one-round blocks; :meth:`gradients` and
    :meth:`ids` wait for it (once) and take their parts.

    Args:
        comm: the data group. recorder: records the exchange (bytes, time, the wait).
        grad: ``(rows, dim)`` contiguous, the gradients of the rows other ranks looked up here.
        grad_send, grad_recv: rows of them to each rank, and of the returning ones from each.
        ids: the exchange whose ids travel along (it is told: ``ids.join(self)``).
    """

    def __init__(self, comm: Communicator, recorder: ExchangeRecorder, grad: torch.Tensor,
                 grad_send: list[int], grad_recv: list[int], ids: Carried) -> None:
        padded, blocks, block_in = ids.padded()
        words = ID_BYTES // grad.element_size()
        self.dim, self.ranks, self.block_in = grad.shape[1], comm.size, block_in
        id_words = padded.to(grad.device).view(grad.dtype)
        pieces: list[torch.Tensor] = []
        for rows, block in zip(grad.split(grad_send), id_words.split([b * words for b in blocks])):
            pieces += [rows.reshape(-1), block]
        self._send: torch.Tensor | None = torch.cat(pieces)
        self._sizes = [size for n in grad_recv for size in (n * self.dim, block_in * words)]
        self._recorder = recorder
        self._started = recorder.start(collectives.alltoallv(
            comm, self._send, [n * self.dim + b * words for n, b in zip(grad_send, blocks)],
            [n * self.dim + block_in * words for n in grad_recv]))
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None
        ids.join(self)

    def _wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._parts is None:
            assert self._send is not None
            got = self._recorder.wait(self._started, self._send).split(self._sizes)
            grads = torch.cat(got[0::2]).view(-1, self.dim)
            ids = torch.cat(got[1::2]).view(torch.int64).view(self.ranks, self.block_in)
            self._parts, self._send = (grads, ids), None
        return self._parts

    def gradients(self) -> torch.Tensor:
        """``(rows, dim)``: the gradients of the rows this rank looked up, from every rank."""
        return self._wait()[0]

    def ids(self) -> torch.Tensor:
        """``(ranks, block)`` int64: each rank's one-round block of ids for this rank."""
        return self._wait()[1]
