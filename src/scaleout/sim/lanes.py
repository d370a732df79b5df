"""The simulated rank's lane queues: which chunks a layer's backward releases, and their
queueing in each lane's fixed order, as the runtime's buckets release them
(:func:`~scaleout.scheduler.chunk_needs`) and its progress engine queues them (a bucket's
chunks in order, a lane's next bucket after the last of them)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from scaleout.scheduler.plan import BucketPlan, chunk_needs, chunks_ready

__all__ = ["Chunk", "LaneQueues"]


@dataclass
class Chunk:
    """A piece of a bucket on its way: the bucket, its bytes and its iteration."""

    bucket: BucketPlan
    nbytes: int
    iteration: int


class LaneQueues:
    """Each lane's queue of released chunks (``queues[lane]``, consumed by the caller).

    Args:
        plans: the buckets (a plan's items, the layers' keys, in backward order).
        lanes: how many lanes the policy runs.
        early_chunks: a chunk leaves once the layers it needs are in; ``False``: a bucket's
            chunks leave together, with its last layer.
    """

    def __init__(self, plans: Sequence[BucketPlan], lanes: int, early_chunks: bool) -> None:
        self.queues: list[deque[Chunk]] = [deque() for _ in range(lanes)]
        # when layer k's backward ends: (plan, chunks that may then leave) per plan whose
        # chunks it completes (its items come in backward order: the plan's key order)
        self._released_at: dict[int, list[tuple[BucketPlan, int]]] = {}
        for plan in plans:
            needs, released = chunk_needs(plan.offsets, plan.chunks), 0
            if not early_chunks:
                needs = (len(plan.keys),) * len(needs)
            for place, key in enumerate(plan.keys):
                ready = chunks_ready(needs, place + 1)
                if ready > released:
                    self._released_at.setdefault(key, []).append((plan, ready))
                released = ready
        # each lane's buckets in their fixed order, and where its queue stands: (iteration,
        # bucket in the lane, its chunks queued); chunks released per (iteration, bucket)
        self._plans = [[p for p in plans if p.lane == lane] for lane in range(lanes)]
        self._at = [(0, 0, 0)] * lanes
        self._released: dict[tuple[int, int], int] = {}

    def produced(self, iteration: int, layer: int) -> list[BucketPlan]:
        """``layer``'s backward of ``iteration`` ended: queue what it releases; returns the
        buckets it released chunks of."""
        touched = []
        for plan, ready in self._released_at.get(layer, ()):
            self._released[iteration, plan.index] = ready
            self._queue(plan.lane)
            touched.append(plan)
        return touched

    def _queue(self, lane: int) -> None:
        it, at, queued = self._at[lane]
        plans = self._plans[lane]
        while True:
            plan = plans[at]
            for start, stop in plan.chunks[queued:self._released.get((it, plan.index), 0)]:
                self.queues[lane].append(Chunk(plan, stop - start, it))
                queued += 1
            if queued < len(plan.chunks):
                break
            at, queued = at + 1, 0
            if at == len(plans):
                it, at = it + 1, 0
        self._at[lane] = (it, at, queued)
