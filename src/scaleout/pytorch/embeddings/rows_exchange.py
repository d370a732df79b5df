"""Step 4 of the collection's forward: the looked-up rows go back to the samples' ranks.

An alltoallv whose backward is the reverse alltoallv of the rows' gradients, divided by the
data group's size (DataParallel's average); the gradients then reach the tables as sparse
row gradients through the lookups' own backward.

The backward exchange either blocks (the lookups' backward runs inside the training loop's
backward, as any autograd function's) or is *deferred*: it starts the reverse alltoallv and
returns at once, so that the rest of backward (the dense layers below, their gradients'
allreduce) runs while the gradients travel; :class:`Landing` then waits for them and runs
the lookups' backward, which leaves exactly the sparse gradients the blocking path leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.pytorch.embeddings.ride import Carried, Ride, can_carry
from scaleout.pytorch.exchange_stats import ExchangeRecorder, Started

__all__ = ["Deferral", "Landing", "exchange_rows"]


class Landing:
    """Rows' gradients on their way back to the tables' holders (deferred backward exchanges),
    oldest first.

    Args:
        divisor: the data group's size (the gradients' average).
        recorder: records the waits (exposed) and the exchanges' time.
    """

    def __init__(self, divisor: int, recorder: ExchangeRecorder) -> None:
        self.divisor, self.recorder = divisor, recorder
        self.active = False  # whether the collection's backward exchanges are deferred
        self._pending: deque[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, rows: torch.Tensor, fetch: Callable[[], torch.Tensor]) -> None:
        """``fetch()`` waits for the gradient of ``rows`` (this rank's lookups, in the
        tables' graph), on its way back from the ranks that asked for them."""
        self._pending.append((rows, fetch))

    def land(self) -> bool:
        """Wait for every pending exchange and run its lookups' backward (the tables' sparse
        ``.grad`` accumulate); whether any was pending."""
        landed = bool(self._pending)
        while self._pending:
            rows, fetch = self._pending.popleft()
            back = fetch()
            if rows.requires_grad:  # (not: frozen tables, or none held here)
                torch.autograd.backward(rows, collectives.average_into(back, back, self.divisor))
        return landed


class Deferral:
    """:meth:`EmbeddingCollection.defer_backward`'s handle: ``remove()`` lands what is
    pending, removes the step hook (if any) and makes backward block again."""

    def __init__(self, landing: Landing, hook: Any) -> None:
        self.landing, self.hook = landing, hook

    def remove(self) -> None:
        self.landing.land()
        self.landing.active = False
        if self.hook is not None:
            self.hook.remove()


def exchange_rows(rows: torch.Tensor, comm: Communicator, send: list[int], recv: list[int],
                  divisor: int, recorder: ExchangeRecorder,
                  started: Started | None = None, landing: Landing | None = None,
                  after_backward: Callable[[], None] | None = None,
                  rider: Callable[[], Carried | None] | None = None) -> torch.Tensor:
    """Send ``send[j]`` of ``rows`` to rank ``j``, receive ``recv[i]`` from rank ``i``.

    Args:
        rows: this rank's lookups for every rank, side by side (in the tables' graph).
        comm: the data group. divisor: its size (the gradients' average).
        recorder: records both exchanges.
        started: the forward exchange when it was started already (the rows were looked up
            and sent ahead, :meth:`EmbeddingCollection.start_lookup`): only waited for.
        landing: defer the backward exchange: backward starts it and adds it to ``landing``
            (whose :meth:`Landing.land` must run before the tables are read or updated);
            ``None``: backward blocks on it.
        after_backward: called once the backward pass that runs the reverse exchange has
            finished (every node of it, hooks included), on every rank.
        rider: called in backward, gives the ids exchange (of a later batch) that waits to
            travel with the rows' gradients (:class:`~scaleout.pytorch.embeddings.ride.Ride`),
            or ``None``: the gradients go alone.

    Returns:
        The rows this rank asked for, in the autograd graph.
    """
    if landing is None and rows.requires_grad:
        return _Exchange.apply(rows, comm, send, recv, divisor, recorder, started, None,
                               after_backward, rider)
    # Whether backward runs the reverse exchange must not depend on this rank's lookups,
    # which need no gradient on a rank holding no table (or no column of its block), or
    # frozen tables: a leaf stands in for them. Deferred, the graph stops here too (a tuple:
    # autograd does not see ``rows`` as an input); the lookups' part of it runs when the
    # gradients land.
    return _Exchange.apply(rows.detach().requires_grad_(), comm, send, recv, divisor,
                           recorder, started, None if landing is None else (rows, landing),
                           after_backward, rider)


class _Exchange(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, comm: Communicator, send: list[int],
                recv: list[int], divisor: int, recorder: ExchangeRecorder,
                started: Started | None,
                deferred: tuple[torch.Tensor, Landing] | None,
                after_backward: Callable[[], None] | None,
                rider: Callable[[], Carried | None] | None) -> torch.Tensor:
        ctx.args = (comm, send, recv, divisor, recorder)
        ctx.deferred, ctx.after_backward, ctx.rider = deferred, after_backward, rider
        if started is not None:
            return recorder.wait(started, rows)
        return recorder.run(rows, lambda: collectives.alltoallv(comm, rows, send, recv).wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        comm, send, recv, divisor, recorder = ctx.args
        if ctx.after_backward is not None:  # (DDP's way to run at the end of backward)
            torch.autograd.Variable._execution_engine.queue_callback(ctx.after_backward)
        grad = grad.contiguous()
        # every rank asks its rider at the same point: the same answer everywhere
        ids = ctx.rider() if ctx.rider is not None and can_carry(grad) else None
        if ids is not None:  # the next batch's ids travel along: one exchange
            fetch = Ride(comm, recorder, grad, recv, send, ids).gradients
        else:
            fetch = partial(recorder.wait, recorder.start(
                collectives.alltoallv(comm, grad, recv, send)), grad)
        if ctx.deferred is not None:
            looked, landing = ctx.deferred
            ctx.deferred = None  # (the lookups' graph is the landing's from here on)
            landing.add(looked, fetch)
            return (None,) * 10
        back = fetch()
        return collectives.average_into(back, back, divisor), *[None] * 9
