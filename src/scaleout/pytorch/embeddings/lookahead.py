"""Looking ahead: a later batch's ids and rows sent before its forward (exact).

:class:`Lookahead` is the part of
:class:`~scaleout.pytorch.embeddings.collection.EmbeddingCollection` that sends a batch's
ids when it is prefetched (:meth:`~Lookahead.prefetch`; with ``ids_with_gradients``, with
the next rows' gradients: :mod:`~scaleout.pytorch.embeddings.ride`) and its rows once the
tables hold what its forward reads (:meth:`~Lookahead.start_lookup`, after an optimizer step
or at the end of backward), and that hands each forward its prefetched batch, in order.
Ids do not depend on the weights, and the rows are read after the update that the forward
would read them after, so the results are those of a forward without lookahead.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.embeddings.backward import TableBackward
from scaleout.pytorch.embeddings.ids_exchange import IdsExchange
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started

__all__ = ["Lookahead"]


class Lookahead(TableBackward):
    """The collection's lookahead (a base class: the collection sets the attributes
    annotated below and defines the three methods that raise here)."""

    comm: Communicator
    exchange_recorder: ExchangeRecorder
    ids_with_gradients: bool
    _pending: deque[IdsExchange]  # prefetched, oldest first
    _started: dict[int, tuple[torch.Tensor, Started]]  # id(exchange): its rows on their way
    _after_backward: OrderedDict[int, bool]  # look_up_after_backward's handles

    def _check(self, ids: torch.Tensor, what: str) -> None:  # (the collection's)
        raise NotImplementedError

    def _exchange(self, ids: torch.Tensor) -> IdsExchange:  # (the collection's)
        raise NotImplementedError

    def _look_up(self, ids: torch.Tensor, asked: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # (the collection's)

    def start_lookup(self) -> bool:
        """Look the next forward's rows up now and start sending them: the first prefetched
        batch's, whose ids are there by now.

        Call it once the tables hold what that forward must read, that is after the tables'
        update of the batch before (:meth:`look_up_after` calls it after every step of the
        tables' optimizer); the forward then waits only for rows already on their way. The
        rows are read when it is called: a table changed after that is not seen by that
        forward (every rank calls it at the same point).

        Returns:
            Whether a lookup started (``False``: no prefetched batch).

        Raises:
            RuntimeError: the first prefetched batch's lookup started already.
        """
        self.land_gradients()  # the rows read below are those after every backward so far
        if not self._pending:
            return False
        exchange = self._pending[0]
        if id(exchange) in self._started:
            raise RuntimeError("EmbeddingCollection.start_lookup: the next batch's rows were "
                               "looked up already (twice without a forward in between)")
        received = exchange.received()
        with torch.enable_grad():  # the forward that takes the rows may train
            looked = self._look_up(received.ids, received.asked)
        self._started[id(exchange)] = (looked, self.exchange_recorder.start(
            collectives.alltoallv(self.comm, looked.detach(), exchange.recv, exchange.send)))
        self._advance()
        return True

    def look_up_after(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`start_lookup` after every ``optimizer.step()`` (the tables' optimizer:
        the rows of the next prefetched batch then leave as soon as the tables are updated).

        Returns:
            The hook's handle (``.remove()`` stops it).

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"EmbeddingCollection.look_up_after: expected a torch optimizer, "
                            f"got {type(optimizer).__name__}")
        return optimizer.register_step_post_hook(lambda *_: self.start_lookup())

    def look_up_after_backward(self) -> RemovableHandle:
        """Call :meth:`start_lookup` at the end of every backward that reaches the tables,
        not after an optimizer step: with :meth:`update_in_backward` the tables then hold
        what the next forward reads, so its rows travel while the dense layers' gradients
        are reduced and their optimizer steps. Every rank of the data group calls it.

        Returns:
            The handle (``.remove()`` stops it).

        Raises:
            RuntimeError: the tables are not updated in backward (they would be read before
                their step); from ``backward()``, when the update in backward was removed
                since.
        """
        if self._batch.update is None:
            raise RuntimeError("EmbeddingCollection.look_up_after_backward: the tables are not "
                               "updated in backward (update_in_backward), so at the end of "
                               "backward they are not what the next forward reads")
        handle = RemovableHandle(self._after_backward)
        self._after_backward[handle.id] = True
        return handle

    def _backward_done(self) -> None:
        if self._batch.update is None:
            raise RuntimeError("EmbeddingCollection: look_up_after_backward needs the tables "
                               "updated in backward, and update_in_backward was removed")
        if self._pending and id(self._pending[0]) not in self._started:
            self.start_lookup()

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start sending the ids of a batch that a later :meth:`forward` will get.

        The exchange of ids (counts, then the ids) then travels while the batches before it
        compute, and that forward waits only for the rows. Ids do not depend on the weights,
        so the result is exactly that of a forward without prefetch. Batches are consumed
        in the order they were prefetched; every rank of the data group must prefetch at the
        same points (each its own batch). :func:`prefetching` does it for a loader. With
        ``ids_with_gradients`` the ids leave with the next backward's rows' gradients.

        Args:
            ids: ``(B, T)`` int64, what a later forward will get (compared with it then).

        Raises:
            TypeError: ids that are not an integer tensor.
            ValueError: ids of the wrong shape, or outside their table's rows.

        Example (each rank, a loop over ``batches``; :func:`prefetching` does the same):
            >>> ec.prefetch(batches[0])
            >>> for step, ids in enumerate(batches):
            ...     if step + 1 < len(batches):
            ...         ec.prefetch(batches[step + 1])   # travels during this step
            ...     loss = head(ec(ids)).sum(); loss.backward(); ...
        """
        self._check(ids, "prefetch")
        exchange = self._exchange(ids.detach().clone())
        if self.ids_with_gradients:  # they go with the next backward's rows' gradients
            exchange.rides = True
        else:
            exchange.start()
        self._pending.append(exchange)

    @property
    def prefetched(self) -> int:
        """How many prefetched batches no forward has taken yet."""
        return len(self._pending)

    def drain(self) -> None:
        """Finish the exchanges of prefetched batches no forward will take (at the end of
        training, say) and forget them; every rank of the data group at the same point
        (deferred gradients land first)."""
        self.land_gradients()
        while self._pending:
            exchange = self._pending.popleft()
            exchange.received()
            _, started = self._started.pop(id(exchange), (None, None))
            if started is not None:
                started.request.wait()

    def _rider(self) -> IdsExchange | None:
        """The oldest prefetched batch whose ids wait for the rows' gradients to carry them
        (``ids_with_gradients``)."""
        return next((e for e in self._pending if e.rides and not e.carried), None)

    def _advance(self) -> None:
        """Start the ids' exchange of every prefetched batch whose counts were sent."""
        for exchange in self._pending:
            exchange.advance()

    def _take(self, ids: torch.Tensor) -> IdsExchange:
        """The exchange of ``ids``: the first prefetched one (which must be of them), or a
        new one."""
        if not self._pending:
            return self._exchange(ids).start()
        first = self._pending.popleft()
        if first.ids.shape != ids.shape or not torch.equal(first.ids, ids.to(first.ids)):
            self._pending.appendleft(first)
            raise ValueError(f"EmbeddingCollection.forward: got other ids than the first of "
                             f"the {len(self._pending)} prefetched batches; forward must take "
                             "the prefetched batches in the order they were prefetched")
        return first

