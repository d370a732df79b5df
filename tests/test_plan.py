"""The communication plan: fusion by codec, issue order, chunking (pure function, no ranks)."""

from __future__ import annotations

import pytest

from scaleout.scheduler import PlanItem, SchedulerConfig, build_plan, chunk_needs, plan_and_policy
from scaleout.scheduler.plan import MAX_CHUNKS

KB = 1024


def _item(key: int, kb: int, codec: str = "") -> PlanItem:
    return PlanItem(key=key, numel=kb * KB // 4, dtype="float32", elem_bytes=4, position=key,
                    codec=codec)


def test_compressed_items_fuse_across_interleaved_exact_ones() -> None:
    # A conv net in forward order: weight (compressed), norm (exact), weight, norm, ...
    items = [_item(k, 64 if k % 2 == 0 else 1, "blockquant" if k % 2 == 0 else "")
             for k in range(8)]
    config = SchedulerConfig(policy="fifo", bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    plans = build_plan(items, config)
    assert [p.keys for p in plans] == [(7, 5, 3, 1), (6, 4, 2, 0)]
    assert [p.codec for p in plans] == ["", "blockquant"]
    # Issued when their last item is ready: the exact bucket's last item (1) comes
    # before the compressed bucket's (0) in backward order.
    assert [p.index for p in plans] == [0, 1]


def test_issue_order_follows_each_buckets_last_item() -> None:
    items = [_item(0, 1), _item(1, 64, "sign"), _item(2, 64, "sign"), _item(3, 1)]
    config = SchedulerConfig(policy="fifo", bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    plans = build_plan(items, config)
    # backward order 3, 2, 1, 0: the sign bucket {2, 1} is complete before the exact {3, 0}
    assert [p.keys for p in plans] == [(2, 1), (3, 0)]


def test_only_exact_buckets_are_chunked() -> None:
    items = [_item(0, 512), _item(1, 4096, "blockquant"), _item(2, 4096)]
    config = SchedulerConfig(policy="priority", bucket_bytes=8 << 20, first_bucket_bytes=8 << 20,
                             partition_bytes=1 << 20, credit_bytes=2 << 20, urgent_bytes=0)
    plans = {p.keys: p for p in build_plan(items, config)}
    assert len(plans[(1,)].chunks) == 1
    assert len(plans[(2, 0)].chunks) == 5  # 4.5 MB in 1 MB chunks


def test_bucket_limit_is_per_codec() -> None:
    items = [_item(k, 300, "cast" if k % 2 else "") for k in range(6)]
    config = SchedulerConfig(policy="fifo", bucket_bytes=700 * KB, first_bucket_bytes=700 * KB)
    plans = build_plan(items, config)
    assert sorted(p.keys for p in plans) == [(0,), (1,), (4, 2), (5, 3)]
    assert all(p.nbytes <= 700 * KB for p in plans)


def test_chunk_needs_counts_the_items_that_start_before_each_chunk_ends() -> None:
    # items of 3, 2 and 5 elements back to back, chunks of 4: item 1 spans chunks 0 and 1
    assert chunk_needs([0, 3, 5], [(0, 4), (4, 8), (8, 10)]) == (2, 3, 3)
    assert chunk_needs([0, 4], [(0, 4), (4, 8)]) == (1, 2)  # a boundary between items
    assert chunk_needs([0], [(0, 10)]) == (1,)


def test_a_big_buckets_front_chunks_need_only_the_items_produced_first() -> None:
    # backward produces 3, 2, 1, 0; one 4 MB bucket in 1 MB chunks: its first chunk holds
    # items 3 and 2, so it may leave before 1 and 0 exist
    items = [_item(k, 512) for k in range(4)] + [_item(4, 1024)]
    config = SchedulerConfig(policy="priority", bucket_bytes=8 << 20, first_bucket_bytes=8 << 20,
                             partition_bytes=1 << 20, credit_bytes=2 << 20, urgent_bytes=0)
    (plan,) = build_plan(items, config)
    assert plan.keys == (4, 3, 2, 1, 0) and len(plan.chunks) == 3
    assert chunk_needs(plan.offsets, plan.chunks) == (1, 3, 5)


def test_an_open_policy_is_priority_only_with_a_bulk_bucket_to_pre_empt() -> None:
    config = SchedulerConfig(partition_bytes=1 << 20, credit_bytes=2 << 20,
                             urgent_bytes=512 << 10)
    # 512 KB first in forward (urgent), then 3 MB of bulk: chunked, so priority
    plans, chosen = plan_and_policy([_item(0, 512), _item(1, 3072)], config)
    assert chosen.policy == "priority" and chosen.lanes == 2
    assert any(p.lane == 1 and len(p.chunks) == 3 for p in plans)
    # bulk that fits one chunk: nothing to pre-empt, so fifo (one lane, whole buckets)
    plans, chosen = plan_and_policy([_item(0, 512), _item(1, 512), _item(2, 256)], config)
    assert chosen.policy == "fifo" and {p.lane for p in plans} == {0}
    assert all(len(p.chunks) == 1 for p in plans)
    # a chosen policy is kept whatever the plan
    for policy in ("priority", "fifo"):
        kept = SchedulerConfig(policy=policy, partition_bytes=1 << 20, credit_bytes=2 << 20)
        assert plan_and_policy([_item(0, 4)], kept)[1].policy == policy


def test_a_plan_of_more_than_max_chunks_is_refused_before_it_is_built() -> None:
    # one (start, stop) per chunk: a 100 TB gradient was 48 million of them, and the
    # simulator never finished (a sim run of a trace). Here 1-byte chunks reach the limit.
    config = SchedulerConfig(policy="priority", partition_bytes=1, credit_bytes=1, urgent_bytes=0)

    def item(key: int, numel: int) -> PlanItem:
        return PlanItem(key=key, numel=numel, dtype="bytes", elem_bytes=1, position=key)

    (plan,) = build_plan([item(0, MAX_CHUNKS)], config)
    assert len(plan.chunks) == MAX_CHUNKS
    with pytest.raises(ValueError, match=f"{MAX_CHUNKS + 1} chunks of partition_bytes=1: "
                                         f"at most {MAX_CHUNKS}.*fifo policy"):
        build_plan([item(0, MAX_CHUNKS - 4), item(1, 5)], config)  # counted over buckets
    # FIFO sends buckets whole: any size is one chunk
    fifo = SchedulerConfig(policy="fifo", bucket_bytes=8 << 20)
    assert build_plan([item(0, 10**14)], fifo)[0].chunks == ((0, 10**14),)
