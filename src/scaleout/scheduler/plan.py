"""The communication plan: which parameter sets travel together, in which lane, in what pieces.

A pure function of the parameter sets' sizes and forward positions and the scheduler
configuration, so that the simulator can plan exactly what the runtime sends.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scaleout.scheduler.config import SchedulerConfig

__all__ = ["MAX_CHUNKS", "PlanItem", "BucketPlan", "build_plan", "chunk_needs", "chunks_ready",
           "plan_and_policy"]

#: The most chunks a plan holds: one ``(start, stop)`` range each, and the simulator prices
#: each as an event. 2**20 is 2 TiB of exact gradients in the default 2 MiB chunks (GPT-3's
#: 651 GiB of fp32 gradients are 333,483 chunks, 12 s to simulate; 2**20 would take ~40 s).
MAX_CHUNKS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PlanItem:
    """One parameter set to communicate.

    Attributes:
        key: the caller's identifier.
        numel: elements.
        dtype: dtype name (items fuse only with items of the same dtype).
        elem_bytes: bytes per element.
        position: forward position (0 = needed first by the next forward).
        fusible: may share a bucket with neighbours (of the same codec).
        codec: the codec that compresses it (any string naming it; ``""``: sent exact).
            Items fuse only with items of the same codec; exact buckets are plain
            allreduces and may be cut into chunks, compressed ones go whole.
    """

    key: int
    numel: int
    dtype: str
    elem_bytes: int
    position: int
    fusible: bool = True
    codec: str = ""

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """A bucket: items fused into one flat buffer, sent as one or more chunks.

    Attributes:
        index: position in the issue order (backward order).
        lane: 0 = most urgent.
        keys: the items' keys, in buffer order.
        offsets: each item's element offset in the buffer.
        numel: elements in the buffer.
        dtype, elem_bytes: of every item.
        position: the smallest forward position of its items (its priority).
        chunks: (start, stop) element ranges, sent in this order.
        fused: True when the bucket may hold several items (else a single special item).
        codec: its items' codec (``""``: exact).
    """

    index: int
    lane: int
    keys: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    elem_bytes: int
    position: int
    chunks: tuple[tuple[int, int], ...]
    fused: bool
    codec: str = ""

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_bytes


def _lanes(items: Sequence[PlanItem], config: SchedulerConfig) -> dict[int, int]:
    if config.lanes == 1:
        return {item.key: 0 for item in items}
    lanes, before = {}, 0
    for item in sorted(items, key=lambda i: i.position):
        lanes[item.key] = 0 if before < config.urgent_bytes else 1
        before += item.nbytes
    return lanes


def chunk_needs(offsets: Sequence[int], chunks: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """For each chunk of a bucket, how many of its items, in buffer order, must be ready
    before it may leave: every item that starts before the chunk's end (an item's gradient
    may span chunks; the chunks before it left first). A bucket's chunks are sent in order,
    so chunk ``k`` leaves as soon as the first ``needs[k]`` items are in: the runtime's
    :class:`~scaleout.session.GradBucket` and the simulator release them so, not when the
    bucket's last item arrives (the items come in buffer order, latest in forward first, so
    the front of a big bucket travels while backward still produces its back).

    Args:
        offsets: each item's first element, ascending (items back to back, none empty).
        chunks: ``(start, stop)`` element ranges, in order, covering the buffer.

    Example:
        >>> chunk_needs([0, 3, 5], [(0, 4), (4, 8)])   # item 1 (3..5) spans both chunks
        (2, 3)
    """
    return tuple(bisect_left(offsets, stop) for _, stop in chunks)


def chunks_ready(needs: Sequence[int], filled: int) -> int:
    """How many of a bucket's chunks may leave once its first ``filled`` items (buffer
    order) are in, ``needs`` being :func:`chunk_needs` (non-decreasing): the runtime's
    bucket and the simulator's lanes release chunks by it.

    Example:
        >>> chunks_ready((2, 3), 2), chunks_ready((2, 3), 3)
        (1, 2)
    """
    return bisect_right(needs, filled)


def _step(elem_bytes: int, config: SchedulerConfig, split: bool) -> int:
    """Elements per chunk of a bucket (0: it goes whole)."""
    return max(config.partition_bytes // elem_bytes, 1) if split else 0


def _chunks(numel: int, step: int) -> tuple[tuple[int, int], ...]:
    if not step or numel == 0:
        return ((0, numel),)
    return tuple((start, min(start + step, numel)) for start in range(0, numel, step))


def build_plan(items: Sequence[PlanItem], config: SchedulerConfig) -> list[BucketPlan]:
    """Group ``items`` into buckets in issue (backward) order.

    Items are issued latest-forward-position first (the order in which backward produces
    their gradients). Fusible items of the same lane, dtype and codec share a bucket, in
    that order, up to ``bucket_bytes`` (``first_bucket_bytes`` for the first one), even when
    items of other codecs come between them; buckets are issued in the order of their last
    items (a lane's order). Under the priority policy every exact bucket is split into
    ``partition_bytes`` chunks, each of which may leave once the items it needs are ready
    (:func:`chunk_needs`); a compressed one travels whole, when its last item is ready (its
    codec works on the whole bucket).

    Raises:
        ValueError: duplicate keys, or a plan of more than :data:`MAX_CHUNKS` chunks.

    Example:
        >>> cfg = SchedulerConfig(policy="fifo", bucket_bytes=64, first_bucket_bytes=64)
        >>> items = [PlanItem(key=k, numel=4, dtype="float32", elem_bytes=4, position=k)
        ...          for k in range(6)]
        >>> [b.keys for b in build_plan(items, cfg)]
        [(5, 4, 3, 2), (1, 0)]
    """
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys):
        raise ValueError(f"plan items must have distinct keys, got {keys}")
    lanes = _lanes(items, config)
    order = sorted(items, key=lambda i: (-i.position, i.key))
    split = config.policy != "fifo"
    groups: list[list[PlanItem]] = []
    # One open bucket per (lane, dtype, codec): compressed weights interleaved with
    # small exact tensors (biases, norms) still fuse with each other.
    # Each open bucket's bytes are kept beside it: summing its items at every append made
    # planning quadratic (10,000 one-element parameters in one bucket: 3.5 s a plan).
    open_buckets: dict[tuple[int, str, str], tuple[list[PlanItem], list[int]]] = {}
    for item in order:
        if not item.fusible:
            groups.append([item])
            continue
        kind = (lanes[item.key], item.dtype, item.codec)
        current, filled = open_buckets.get(kind, (None, [0]))
        limit = config.first_bucket_bytes if groups and current is groups[0] else config.bucket_bytes
        if current is not None and filled[0] + item.nbytes <= limit:
            current.append(item)
            filled[0] += item.nbytes
            continue
        open_buckets[kind] = ([item], [item.nbytes])
        groups.append(open_buckets[kind][0])
    # Issue order: by each bucket's last item (backward order).
    rank_of = {item.key: n for n, item in enumerate(order)}
    groups.sort(key=lambda group: rank_of[group[-1].key])
    sizes = [sum(i.numel for i in group) for group in groups]
    steps = [_step(g[0].elem_bytes, config, split and g[0].fusible and not g[0].codec)
             for g in groups]
    count = sum(-(-numel // step) if step and numel else 1 for numel, step in zip(sizes, steps))
    if count > MAX_CHUNKS:
        raise ValueError(
            f"the plan would cut {sum(i.nbytes for i in items)} bytes into {count} chunks of "
            f"partition_bytes={config.partition_bytes}: at most {MAX_CHUNKS} (MAX_CHUNKS); "
            "use larger chunks, or the fifo policy, which sends each bucket whole")
    plans = []
    for index, (group, total, step) in enumerate(zip(groups, sizes, steps)):
        offsets, start = [], 0
        for item in group:
            offsets.append(start)
            start += item.numel
        head = group[0]
        plans.append(BucketPlan(
            index=index, lane=lanes[head.key], keys=tuple(i.key for i in group),
            offsets=tuple(offsets), numel=total, dtype=head.dtype, elem_bytes=head.elem_bytes,
            position=min(i.position for i in group), chunks=_chunks(total, step),
            fused=head.fusible, codec=head.codec,
        ))
    return plans


def plan_and_policy(items: Sequence[PlanItem], config: SchedulerConfig
                    ) -> tuple[list[BucketPlan], SchedulerConfig]:
    """:func:`build_plan` with an open policy (``config.policy is None``) decided, and the
    configuration it was built under: ``"priority"`` when its bulk lane has a bucket cut into
    several chunks (a transfer that urgent data pre-empts at chunk boundaries), else
    ``"fifo"``. With nothing to pre-empt, two lanes only run two exchanges at once, each on
    its own communicator and threads, and on a host whose cores also compute that costs
    more than the order gains (DLRM's tables row-sparse on the CPU, 2 ranks: 1.3x faster at
    1 and 10 Gbit/s with fifo, 0.92x at 100 Mbit/s; RESULTS.md, stop 34). The runtime's
    sessions and the simulator both plan through here.

    Example:
        >>> small = [PlanItem(key=k, numel=1000, dtype="float32", elem_bytes=4, position=k)
        ...          for k in range(3)]
        >>> plan_and_policy(small, SchedulerConfig())[1].policy
        'fifo'
    """
    if config.policy is not None:
        return build_plan(items, config), config
    chosen = replace(config, policy="priority")
    plans = build_plan(items, chosen)
    if not any(plan.lane > 0 and len(plan.chunks) > 1 for plan in plans):
        chosen = replace(config, policy="fifo")
        plans = build_plan(items, chosen)
    return plans, chosen
