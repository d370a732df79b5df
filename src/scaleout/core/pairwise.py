"""All-to-all and all-gather over gloo as point-to-point messages, every receive posted first.

Gloo (``gloo/transport/tcp/pair.cc``) sends a buffer only after the peer's *recv-ready*
notice, and that notice travels in the same per-pair FIFO as data. Gloo's own alltoall and
allgather post each send before the matching receive, so on a pair that carries data both
ways a late rank's notice queues behind its own data and the two directions run one after
the other: at 2 ranks torch's ``all_to_all_single`` took 137 ms for 8 MB each way at
1 Gbit/s where full duplex takes ~68 ms, and ``all_gather_into_tensor`` 254-354 ms for
16 MB each way where 136 ms would do (benchmarks/RESULTS.md §1; the simulator's model of it
is :mod:`scaleout.sim.gloo_pairs`). Posting every receive before any send (as gloo's
allreduce does) sends every notice first, so both directions run at once.

These exchanges are built from ``torch.distributed.irecv`` / ``isend`` (no transport of our
own): receives from every peer first, then sends to every peer, this rank's own block
copied locally. They carry the same bytes as gloo's collectives (an allgather sends this
rank's block to each peer directly rather than around a ring: ``p - 1`` blocks out either
way). Used for CPU tensors on gloo groups where it was measured to pay (:func:`recv_first`),
and only where every rank reaches the same decision from what it knows: an all-to-all-v
takes it at 2 ranks only (each rank sees only its own blocks; at 2 both see the same two);
``SCALEOUT_GLOO_RECV_FIRST=0`` turns it off (torch's collectives then run unchanged). Messages match by order per pair, so every rank must
issue these calls in the same order on a group, as with any collective.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["ENV_VAR", "MIN_BLOCK_BYTES", "PairwiseWork", "cpu_on_gloo", "recv_first",
           "exchange_blocks", "setting"]

ENV_VAR = "SCALEOUT_GLOO_RECV_FIRST"


#: Blocks smaller than this go through gloo's own collective: on the 1 Gbit/s testbed the
#: point-to-point exchange was slower below it (2 ranks: alltoall of 128 KB per peer 2.4x
#: torch's time, 256 KB per peer 0.89x; allgather of 128 KB 2.4x, 256 KB 0.78x).
MIN_BLOCK_BYTES = 256 * 1024


def setting() -> str:
    """This process's ``SCALEOUT_GLOO_RECV_FIRST`` choice, as the collectives' consistency
    check names it: ranks that differ would take different paths for one call (and wait
    for each other until the timeout), so it is part of what they check they agree on."""
    return "recv_first=" + ("off" if os.environ.get(ENV_VAR, "1") == "0" else "on")


def recv_first(group: Any, tensor: torch.Tensor, block_bytes: int, *, ranks: int,
               gather: bool = False) -> bool:
    """Whether an all-to-all (or, with ``gather``, an all-gather) of ``tensor`` on ``group``
    goes through :func:`exchange_blocks`: a CPU tensor on a group whose CPU backend is gloo,
    blocks of at least :data:`MIN_BLOCK_BYTES` (``block_bytes``: the largest block one peer
    gets), and for an all-gather 2 ranks (at 3, gloo's ring was as fast: 1.03-1.16x torch's
    time with the exchange); never with ``SCALEOUT_GLOO_RECV_FIRST=0``."""
    if (tensor.device.type != "cpu" or block_bytes < MIN_BLOCK_BYTES or (gather and ranks != 2)
            or os.environ.get(ENV_VAR, "1") == "0"):
        return False
    return cpu_on_gloo(group)


def cpu_on_gloo(group: Any) -> bool:
    """Whether ``group`` is a torch process group whose CPU backend is gloo."""
    try:
        backend = str(tdist.get_backend(group))
    except (RuntimeError, ValueError):  # not a torch process group
        return False
    return backend == "gloo" or "cpu:gloo" in backend


class PairwiseWork:
    """The point-to-point works of one exchange as one work.

    Gloo's ``irecv`` / ``isend`` works must be waited on by one thread, once: each
    ``wait`` consumes one completion of the underlying buffer, so a second waiter (a future's
    thread beside the training loop's wait, as when an exchange is also timed) blocks
    until its timeout although the messages went through, and a ``wait(timeout)`` that
    times out aborts the work. Here one waiter thread, started at the first
    :meth:`wait`, :meth:`is_completed` or :meth:`get_future`, waits on them all for the
    communicator's timeout; every caller waits for that thread's outcome instead, in slices
    if it likes (so the watchdog can name a dead peer between slices). A peer that dies
    still ends the wait at once (gloo reports the closed connection).

    Args:
        works: the started ``isend`` / ``irecv`` works.
        timeout_s: the longest the waiter thread waits for them.
    """

    def __init__(self, works: Sequence[Any], timeout_s: float) -> None:
        self._works = list(works)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None

    def _waiter(self) -> torch.futures.Future:
        """The future of the one thread that waits on the works (started once)."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                threading.Thread(target=self._wait_all, daemon=True,
                                 name="scaleout-pairwise").start()
            return self._future

    def _wait_all(self) -> None:
        assert self._future is not None
        deadline = time.monotonic() + self._timeout_s
        try:
            for work in self._works:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except BaseException as err:  # noqa: BLE001 - handed to every waiter
            self._error = err
        self._finished.set()  # (after the error is set: waiters read it)
        if self._error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(self._error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until every message is through; raise what failed.

        Raises:
            RuntimeError: ``timeout`` passed first ("timed out"; the exchange goes on and a
                later ``wait`` may still succeed), or a message failed (a peer closed the
                connection, or the waiter thread's own timeout passed).
        """
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._waiter()
        if not self._finished.wait(seconds):
            raise RuntimeError(f"pairwise exchange: timed out after {seconds:.3f} s waiting "
                               f"for {len(self._works)} point-to-point messages")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether every message is through (starts the waiter thread: only it completes the
        works, so a caller that only polls would otherwise poll forever)."""
        self._waiter()
        return self._finished.is_set()

    def get_future(self) -> torch.futures.Future:
        """A future completed (or failed) when every message is through."""
        return self._waiter()


def exchange_blocks(group: Any, ranks: Sequence[int], rank: int,
                    sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor],
                    timeout_s: float) -> list[Any]:
    """Send ``sends[j]`` to group rank ``j`` and receive ``recvs[i]`` from group rank ``i``,
    every receive posted before any send; this rank's own block is copied.

    Args:
        group: the process group.
        ranks: the group's global ranks, in group-rank order.
        rank: this process's group rank.
        sends: one contiguous tensor per group rank (``sends[rank]`` is copied into
            ``recvs[rank]``).
        recvs: one contiguous tensor per group rank, written in place.
        timeout_s: the longest the messages may take (the communicator's timeout).

    Returns:
        One :class:`PairwiseWork` (none when there is nothing to send or receive).

    Raises:
        ValueError: ``sends`` or ``recvs`` does not hold one tensor per rank, or this
            rank's send and receive blocks differ in size.
    """
    size = len(ranks)
    if len(sends) != size or len(recvs) != size:
        raise ValueError(f"exchange_blocks: expected {size} send and receive blocks, got "
                         f"{len(sends)} and {len(recvs)}")
    if sends[rank].numel() != recvs[rank].numel():
        raise ValueError(f"exchange_blocks: this rank's own block has {sends[rank].numel()} "
                         f"elements to send but {recvs[rank].numel()} to receive")
    # Peers in the order gloo's alltoall uses (rank + i, rank - i): every pair's two
    # directions are posted at comparable points on both sides.
    peers = [(rank - i) % size for i in range(1, size)]
    works = [tdist.irecv(recvs[p], src=ranks[p], group=group) for p in peers
             if recvs[p].numel()]
    works += [tdist.isend(sends[p], dst=ranks[p], group=group)
              for p in ((rank + i) % size for i in range(1, size)) if sends[p].numel()]
    recvs[rank].copy_(sends[rank].view_as(recvs[rank]))
    return [PairwiseWork(works, timeout_s)] if works else []
