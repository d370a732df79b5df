"""``EmbeddingCollection(max_batch=...)``: a batch's id counts and ids travel in one alltoallv
(blocks padded to what ``max_batch`` samples can send) instead of two, with the same results:
the single-process DLRM comparison on every layout, fewer collectives, and clear errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import scaleout
from dlrm_oracle import CONFIG, body_dlrm
from harness import run_ranks
from scaleout.core import collectives
from scaleout.pytorch import COLUMN_WISE, ROW_WISE, EmbeddingCollection, ShardingPlan, TableSpec
from scaleout.pytorch.embeddings.ids_exchange import id_capacity


@pytest.mark.parametrize("data_parts,model_parts,mode,layout,prefetch,update", [
    (2, 1, "overlap", "planned", "loader", "step"),
    (3, 1, "sync", "budget", "two ahead", "step"),  # a row-wise table
    (2, 2, "overlap", "columns", "loader", "step"),  # column-wise tables, tensor parallel too
    (3, 1, "overlap", "idle", "after backward", "backward"),  # a rank holding no table
    (2, 1, "sync", "explicit", "none", "backward")])
def test_ids_in_one_round_match_single_process(data_parts: int, model_parts: int, mode: str,
                                               layout: str, prefetch: str, update: str) -> None:
    held = run_ranks(data_parts * model_parts, body_dlrm, data_parts, model_parts, mode, layout,
                     prefetch, "no", update, "one round", timeout=120)
    assert set(t for h in held for t in h) == set(range(len(CONFIG.table_sizes)))


def test_capacity_is_what_max_batch_samples_can_send() -> None:
    # at most min(max_batch, rows) distinct ids per table a rank holds (all of a split
    # table's go to each of its holders)
    assert id_capacity([[0, 2], [1, 2], []], [100, 3, 8], 5) == [5 + 5, 3 + 5, 0]


#: Four small tables on 2 ranks: row-wise, column-wise, and one whole on each rank.
SMALL_ROWS = (6, 3, 5, 4)


def small_plan() -> tuple[tuple[TableSpec, ...], ShardingPlan]:
    specs = tuple(TableSpec(rows=r, dim=2) for r in SMALL_ROWS)
    return specs, ShardingPlan(tables=specs, owners=(ROW_WISE, COLUMN_WISE, 0, 1), ranks=2,
                               element_size=4)


@contextlib.contextmanager
def counting_alltoallv() -> Iterator[list[object]]:
    """Every ``collectives.alltoallv`` call's send counts, while inside."""
    calls: list[object] = []
    real = collectives.alltoallv

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    collectives.alltoallv = counted
    try:
        yield calls
    finally:
        collectives.alltoallv = real


def body_one_round() -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    specs, plan = small_plan()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2) for r in SMALL_ROWS]
    batches = [torch.tensor([[5, 2, 4, 3], [0, 2, 4, 0], [5, 1, 0, 3]]),  # repeated ids
               torch.zeros(0, 4, dtype=torch.long)]  # rank 1 looks nothing up
    with counting_alltoallv() as calls:
        outs = {}
        for max_batch in (None, 3):
            ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan, max_batch=max_batch)
            calls.clear()
            ec.prefetch(batches[env.rank])
            out = ec(batches[env.rank])
            outs[max_batch] = (len(calls), out)
            out.pow(2).sum().backward()
        # ids: counts then ids (2) or both at once (1); then the rows, once either way
        assert outs[None][0] == 3 and outs[3][0] == 2, {k: v[0] for k, v in outs.items()}
        assert torch.equal(outs[None][1], outs[3][1])
        want = torch.stack([e(batches[env.rank][:, t]) for t, e in enumerate(plain)], 1)
        assert torch.equal(outs[3][1], want)
        with pytest.raises(ValueError, match=r"EmbeddingCollection.prefetch: a batch of 4 "
                                             r"samples, more than max_batch=3"):
            ec.prefetch(torch.zeros(4, 4, dtype=torch.long))
        with pytest.raises(ValueError, match=r"forward: a batch of 4 samples"):
            ec(torch.zeros(4, 4, dtype=torch.long))
    # every rank must give the same max_batch (it sizes the blocks a rank receives)
    with pytest.raises(ValueError, match=r"the ranks called different collectives .*"
                                         r"max_batch 3.*max_batch 4"):
        EmbeddingCollection(specs, dist, plan=plan, max_batch=3 + env.rank)
    env.finalize()


def test_one_round_sends_the_same_ids_with_one_collective_fewer() -> None:
    run_ranks(2, body_one_round, timeout=60)


@pytest.mark.parametrize("bad,error,message", [
    (0, ValueError, "max_batch must be >= 1, got 0"),
    (2.0, TypeError, "max_batch must be an int or None, got float"),
    (True, TypeError, "max_batch must be an int or None, got bool")])
def test_a_bad_max_batch_is_refused(bad: object, error: type, message: str) -> None:
    # checked before any collective: no process group needed
    with pytest.raises(error, match=message):
        EmbeddingCollection([TableSpec(rows=3, dim=2)], None, max_batch=bad)  # type: ignore
