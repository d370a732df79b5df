"""``EmbeddingCollection(ids_with_gradients=True)``: a prefetched batch's ids travel with the
rows' gradients of the backward before it, in one alltoallv, with the same results: the
single-process DLRM comparison on every layout, one collective fewer, and clear errors."""

from __future__ import annotations

import pytest
import torch

import scaleout
from dlrm_oracle import CONFIG, body_dlrm
from harness import run_ranks
from scaleout.core import pairwise
from scaleout.pytorch import EmbeddingCollection, FusedSGD, TableSpec
from test_ids_one_round import SMALL_ROWS, counting_alltoallv, small_plan


@pytest.mark.parametrize("data_parts,model_parts,mode,layout,prefetch,defer,update", [
    (2, 1, "overlap", "planned", "loader", "no", "step"),
    (3, 1, "sync", "budget", "two ahead", "no", "step"),  # a row-wise table
    (2, 2, "overlap", "columns", "loader", "step", "step"),  # columns, TP, deferred backward
    (3, 1, "overlap", "idle", "after backward", "no", "backward"),  # a rank holding no table
    (2, 1, "sync", "explicit", "none", "no", "backward")])  # nothing prefetched: none carried
def test_ids_with_gradients_match_single_process(data_parts: int, model_parts: int, mode: str,
                                                 layout: str, prefetch: str, defer: str,
                                                 update: str) -> None:
    held = run_ranks(data_parts * model_parts, body_dlrm, data_parts, model_parts, mode, layout,
                     prefetch, defer, update, "with gradients", timeout=120)
    assert set(t for h in held for t in h) == set(range(len(CONFIG.table_sizes)))


def test_large_exchanges_through_receive_first_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    # every block through the point-to-point exchange (threshold 0; the ranks are forked from
    # here), as the tables' exchanges of a large batch go: with DataParallel timing them, a
    # second waiter once hung them (tests/test_pairwise.py)
    monkeypatch.setattr(pairwise, "MIN_BLOCK_BYTES", 0)
    run_ranks(2, body_dlrm, 2, 1, "overlap", "planned", "after backward", "no", "backward",
              "with gradients", timeout=120)
    run_ranks(2, body_dlrm, 2, 1, "overlap", "planned", "loader", "step", "step", "one round",
              timeout=120)


def body_with_gradients(dtype: torch.dtype) -> None:
    env = scaleout.init(timeout=30)
    dist = env.create_distribution()
    specs, plan = small_plan()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2, dtype=dtype) for r in SMALL_ROWS]
    batches = [[torch.tensor([[5, 2, 4, 3], [0, 2, 4, 0], [5, 1, 0, 3]]),  # repeated ids
                torch.tensor([[1, 0, 3, 2], [4, 1, 1, 1]])],
               [torch.zeros(0, 4, dtype=torch.long),  # rank 1 looks nothing up, then 3 ids
                torch.tensor([[5, 2, 2, 0], [3, 2, 4, 1], [0, 0, 0, 0]])]][env.rank]
    with counting_alltoallv() as calls:
        runs = {}
        for riding in (False, True):
            ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan, max_batch=3,
                                                     ids_with_gradients=riding)
            ec.update_in_backward(FusedSGD(lr=0.5))
            calls.clear()
            outs = []
            ec.prefetch(batches[0])
            for step, ids in enumerate(batches):
                if step + 1 < len(batches):
                    ec.prefetch(batches[step + 1])
                out = ec(ids)
                out.mul(torch.arange(1, 9, dtype=dtype).view(1, 4, 2)).pow(2).sum().backward()
                outs.append(out.detach())
            runs[riding] = (len(calls), outs, ec.full_state())
    # alone: 2 x (ids, rows, gradients); riding: the second batch's ids go with the first
    # batch's gradients (the first batch's, prefetched before any backward, alone)
    assert runs[False][0] == 6 and runs[True][0] == 5, {k: v[0] for k, v in runs.items()}
    for a, b in zip(runs[False][1], runs[True][1]):
        assert torch.equal(a, b)
    for name, value in runs[False][2].items():
        assert torch.equal(value, runs[True][2][name]), name
    with pytest.raises(ValueError, match=r"the ranks called different collectives .*"
                                         r"ids with gradients False.*ids with gradients True"):
        EmbeddingCollection(specs, dist, plan=plan, max_batch=3,
                            ids_with_gradients=env.rank == 1)
    env.finalize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ids_with_gradients_send_the_same_with_one_collective_fewer(dtype: torch.dtype) -> None:
    # the ids travel as 2, 1 or 4 words of the gradients' dtype, bit for bit
    run_ranks(2, body_with_gradients, dtype, timeout=60)


@pytest.mark.parametrize("riding,max_batch,error,message", [
    (True, None, ValueError, "ids_with_gradients needs max_batch"),
    (1, 4, TypeError, "ids_with_gradients must be a bool, got int")])
def test_bad_ids_with_gradients_are_refused(riding: object, max_batch: int | None, error: type,
                                            message: str) -> None:
    # checked before any collective: no process group needed
    with pytest.raises(error, match=message):
        EmbeddingCollection([TableSpec(rows=3, dim=2)], None, max_batch=max_batch,  # type: ignore
                            ids_with_gradients=riding)  # type: ignore[arg-type]
