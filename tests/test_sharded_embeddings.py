"""Sharded embedding tables (DLRM): hybrid training equals single-process training.

The tables are sharded table-wise (and, under a memory budget, row-wise; explicitly,
column-wise; or leaving a rank with none) over the data group (alltoallv of each table's
distinct ids and of their rows, reverse alltoallv of the rows' summed gradients, row-wise
sparse updates); the dense MLPs stay data parallel
(and, on a 2 x 2 grid, tensor parallel too). Float64, tight tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import scaleout
from dlrm_oracle import CONFIG, body_dlrm, run_dlrm_cases
from harness import run_ranks
from scaleout.pytorch import (
    COLUMN_WISE,
    ROW_WISE,
    EmbeddingCollection,
    RowWiseAdagrad,
    ShardingPlan,
    TableSpec,
    full_state_dict,
    load_full_state_dict,
    plan_tables,
    prefetching,
)
from scaleout.pytorch.embeddings.batched import TableBatch

#: (data_parts, model_parts, mode, layout, prefetch)
HYBRID = [
    (2, 1, "sync", "planned", "none"), (3, 1, "overlap", "planned", "none"),
    (2, 2, "overlap", "planned", "none"), (1, 2, "overlap", "planned", "none"),
    (2, 1, "overlap", "explicit", "none"),
    (3, 1, "sync", "budget", "none"), (2, 1, "sync", "columns", "none"),
    (3, 1, "overlap", "columns", "none"), (3, 1, "overlap", "idle", "none"),
    # the ids of the next batch (or two) exchanged while a batch trains: the same weights
    (2, 1, "overlap", "planned", "loader"), (3, 1, "sync", "budget", "two ahead"),
    (2, 2, "overlap", "columns", "loader"), (3, 1, "overlap", "idle", "two ahead"),
    (3, 1, "overlap", "idle", "loader")]


def test_hybrid_dlrm_matches_single_process() -> None:  # every case of HYBRID
    for case, held in run_dlrm_cases(HYBRID).items():
        model_parts, layout = case[1], case[3]
        by_data_rank = held[::model_parts]
        tables = set(t for h in by_data_rank for t in h)
        assert tables == set(range(len(CONFIG.table_sizes))), case
        assert layout != "idle" or held[-1] == [], case
        for m in range(model_parts):  # every model rank holds the same tables as its column
            assert held[m::model_parts] == by_data_rank, case


DEFERRED = [(2, 1, "overlap", "planned", "loader"), (2, 1, "sync", "planned", "none"),
            (3, 1, "overlap", "budget", "two ahead"), (2, 2, "overlap", "columns", "loader"),
            (3, 1, "overlap", "idle", "loader")]


def test_deferred_backward_matches_single_process() -> None:  # every case of DEFERRED
    # the rows' gradients travel while the dense backward runs, land before the tables' step
    for case, held in run_dlrm_cases([(*case, "step") for case in DEFERRED]).items():
        assert set(t for h in held for t in h) == set(range(len(CONFIG.table_sizes))), case


def test_deferred_gradients_landing_after_the_step_are_caught() -> None:
    # the oracle above notices a landing that misses the step: the tables then lag one step
    off = run_ranks(2, body_dlrm, 2, 1, "overlap", "planned", "loader", "late", timeout=120)
    assert off == [14, 14], off  # all 14: 6 tables, 8 dense tensors trained on stale rows


def test_planner_balances_and_respects_the_budget() -> None:
    tables = [TableSpec(rows=r, dim=16, name=f"t{i}") for i, r in enumerate(
        (20000, 10000, 5000, 2000, 1000, 500, 200, 100) * 2)]
    plan = plan_tables(tables, 4)
    memory = [plan.memory_of(r) for r in range(4)]
    assert max(memory) <= 1.05 * sum(memory) / 4 + tables[0].nbytes(4) / 2
    assert "rank 3:" in plan.describe()
    total = sum(t.nbytes(4) for t in tables)
    budget = total // 4 + 200000
    tight = plan_tables(tables, 4, memory_budget=budget)
    assert max(tight.memory_of(r) for r in range(4)) <= budget
    with pytest.raises(ValueError, match=r"table t\d+ \(\d+ x 16, \d+ bytes\) fits on no rank "
                                         r"under the memory budget of 1000000 bytes per rank, "
                                         r"whole or row-wise"):
        plan_tables(tables, 4, memory_budget=1_000_000)  # 1.24 MB per rank at least
    with pytest.raises(ValueError, match=r"memory_budget must be bytes, an int >= 1, got 0"):
        plan_tables(tables, 4, memory_budget=0)
    small = [TableSpec(rows=100, dim=1, name="big"), TableSpec(rows=10, dim=1),
             TableSpec(rows=10, dim=1)]
    split = plan_tables(small, 2, memory_budget=300)  # "big" (400 bytes) fits no rank whole
    assert split.owners[0] == ROW_WISE and split.rows_of(0, 1) == (50, 50)
    assert "big (rows 0+50)" in split.describe()


def test_rowwise_adagrad_sparse_equals_dense() -> None:
    torch.manual_seed(0)
    sparse = torch.nn.Embedding(10, 3, sparse=True).double()
    dense = torch.nn.Embedding(10, 3).double()
    dense.load_state_dict(sparse.state_dict())
    opts = [RowWiseAdagrad(m.parameters(), lr=0.1) for m in (sparse, dense)]
    for step in range(3):
        ids = torch.tensor([step, 4, 4, 7])
        for m, opt in zip((sparse, dense), opts):
            m(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(sparse.weight, dense.weight)
    assert not torch.equal(sparse.weight[4], dense.weight.new_zeros(3))
    assert opts[0].state[sparse.weight]["sum"].numel() == 10  # one value per row


def body_constructor_errors() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    spec = TableSpec(rows=3, dim=4)
    with pytest.raises(TypeError, match="dtype must be a floating torch dtype, got torch.int64"):
        EmbeddingCollection([spec], dist, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"tables must be a sequence of TableSpec, got TableSpec"):
        EmbeddingCollection(spec, dist)
    with pytest.raises(TypeError, match="distribution must be a scaleout.Distribution or None, "
                                        "got str"):
        EmbeddingCollection([spec], "data")
    assert EmbeddingCollection([spec]).held() == [0]  # None: the job's ranks, like DataParallel
    env.finalize()


def test_constructor_errors_name_the_argument() -> None:
    run_ranks(1, body_constructor_errors, timeout=30)


def body_prefetch_errors() -> None:
    env = scaleout.init(timeout=60)
    dist = env.create_distribution()
    ec = EmbeddingCollection([TableSpec(rows=r, dim=3) for r in (9, 5, 4)], dist)
    first, second = (torch.tensor([[env.rank, s, 1], [2, 0, s]]) for s in (0, 3))
    reference = ec(second).detach()
    with pytest.raises(ValueError, match=r"expected ids of shape \(batch, 3\), got \(2, 4\)"):
        ec.prefetch(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="expected an int64 \\(or int32\\) tensor of ids"):
        ec.prefetch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"ids of table 1 must be in \[0, 5\), got 0..5"):
        ec(torch.tensor([[0, 5, 0], [1, 0, 3]]))  # 5 would alias row 0 of table 2
    ec.prefetch(first)
    ec.prefetch(second)
    with pytest.raises(ValueError, match="got other ids than the first of the 2 prefetched"):
        ec(second)  # checked before anything is sent: every rank raises, nothing is left over
    assert ec.prefetched == 2
    ec(first)
    assert torch.equal(ec(second), reference) and ec.prefetched == 0
    ec.prefetch(first)  # never taken: drained
    ec.drain()
    assert ec.prefetched == 0 and torch.equal(ec(second), reference)
    with pytest.raises(TypeError, match="ids must pick a batch's ids"):
        prefetching([first], ec, ids=None)
    assert list(prefetching([], ec, ids=lambda b: b)) == [] and ec.prefetched == 0
    env.finalize()


def test_prefetch_checks_its_batches() -> None:
    run_ranks(2, body_prefetch_errors, timeout=60)


def body_deferred_accumulates() -> None:
    env = scaleout.init(timeout=60)
    dist = env.create_distribution()
    specs = [TableSpec(rows=r, dim=3) for r in (9, 5, 4)]
    blocking, deferred = (EmbeddingCollection(specs, dist) for _ in range(2))
    with pytest.raises(TypeError, match="expected a torch optimizer or None, got list"):
        deferred.defer_backward([])
    handle = deferred.defer_backward(None)  # no step: they land at the next forward
    batches = [torch.tensor([[env.rank, s, 1], [2, 0, s]]) for s in (0, 3)]
    for ids in batches:  # two backward passes, no step: the tables' gradients accumulate
        for ec in (blocking, deferred):
            (ec(ids) * torch.arange(1.0, 4.0)).pow(2).sum().backward()
    assert len(deferred._landing) == 1  # the first landed at the second forward
    assert deferred.land_gradients() and not deferred.land_gradients()
    for t in blocking.held():
        want, got = (ec.get_submodule(str(t)).weight.grad for ec in (blocking, deferred))
        assert torch.equal(got.to_dense(), want.to_dense()), t
    handle.remove()  # backward blocks again
    deferred(batches[0]).sum().backward()
    assert len(deferred._landing) == 0 and not deferred.land_gradients()
    env.finalize()


def test_deferred_gradients_accumulate_like_blocking_ones() -> None:
    run_ranks(2, body_deferred_accumulates, timeout=60)


def test_table_batch_looks_up_every_table_in_one_gather_like_one_lookup_each() -> None:
    # tables of 6 (whole), 9 (my rows 3..7 of a row-wise one), one kept apart, 4 (whole)
    blocks, rows = [(0, 6), (3, 5), None, (0, 4)], [6, 9, 7, 4]
    batch = TableBatch(blocks, rows, dim=3, dtype=torch.float32)
    assert not batch.whole and batch.weight.shape == (15, 3)
    weights = [torch.nn.Parameter(batch.view(j)) for j in batch.members]
    for w, j in zip(weights, batch.members):
        w.data = batch.view(j)
        w.data.copy_(torch.randn(w.shape))
    assert all(w.data_ptr() == batch.view(j).data_ptr() for w, j in zip(weights, batch.members))
    table = torch.tensor([0, 1, 3, 1, 2, 0, 3, 1, 0])
    ids = torch.tensor([5, 2, 3, 7, 6, 5, 0, 4, 1])  # 2 and 8 are not my rows of table 1
    looked = batch.look_up(batch.rows(ids, table), table, weights)
    blocks_of = dict(zip(batch.members, weights))
    want = torch.stack([blocks_of[int(t)][int(i) - blocks[int(t)][0]]
                        if blocks[int(t)] and 0 <= int(i) - blocks[int(t)][0] < blocks[int(t)][1]
                        else torch.zeros(3) for t, i in zip(table, ids)])
    assert torch.equal(looked, want)
    grad = torch.randn(9, 3)
    looked.backward(grad)
    for j, w in zip(batch.members, weights):  # each table's sparse gradient of its rows
        first, count = blocks[j]
        dense = torch.zeros(count, 3)
        for k, (t, i) in enumerate(zip(table.tolist(), ids.tolist())):
            if t == j and first <= i < first + count:
                dense[i - first] += grad[k]
        assert w.grad.is_sparse and torch.equal(w.grad.to_dense(), dense), j
    for w in weights:  # module.double() replaces the data: the next lookup rebinds them
        w.data = w.data.double()
    again = batch.look_up(batch.rows(ids, table), table, weights)
    assert again.dtype == torch.float64 and torch.equal(again, want.double())
    assert all(w.data_ptr() == batch.view(j).data_ptr() for w, j in zip(weights, batch.members))


def body_narrow_column_block() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2).double() for r in (5, 4)]
    # table 0 split by columns over 3 ranks: rank 2's block is 0 columns wide, its only one
    plan = ShardingPlan(tables=(TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2)),
                        owners=(COLUMN_WISE, 0), ranks=3, element_size=8)
    assert plan.cols_of(0, 2) == (2, 0) and plan.tables_of(2) == [0]
    ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan)
    batches = [torch.tensor([[r, r % 4], [4, 3], [r, 0]]) for r in range(3)]
    scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))  # a dense layer
    (ec(batches[env.rank]) * scale).pow(2).sum().backward()  # every rank's exchange runs
    for r, ids in enumerate(batches):  # the reference: DataParallel's average of the ranks
        (sum(e(ids[:, t]).pow(2).sum() for t, e in enumerate(plain)) / 3).backward()
    for t in ec.held():
        first, count = plan.rows_of(t, env.rank)
        column, width = plan.cols_of(t, env.rank)
        want = plain[t].weight.grad[first: first + count, column: column + width]
        grad = ec.get_submodule(str(t)).weight.grad
        got = torch.zeros_like(want) if grad is None else grad.to_dense()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    env.finalize()


def test_a_rank_whose_only_block_has_no_columns_joins_the_backward_exchange() -> None:
    # its lookups did not require grad, so its backward skipped the reverse exchange that
    # the other ranks waited in (they timed out)
    run_ranks(3, body_narrow_column_block, timeout=40)


def body_frozen_tables(defer: bool) -> list[float]:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2).double() for r in (5, 4)]
    plan = ShardingPlan(tables=(TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2)),
                        owners=(0, 0), ranks=2, element_size=8)  # rank 1 holds no table
    ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan)
    ec.requires_grad_(False)  # pretrained tables, frozen: only the dense layers train
    if defer:
        ec.defer_backward(None)
    ids = torch.tensor([[env.rank, 2], [4, env.rank]])
    scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    (ec(ids) * scale).pow(2).sum().backward()
    ec.land_gradients()
    assert all(p.grad is None for p in ec.parameters())
    want = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    (torch.stack([e(ids[:, t]) for t, e in enumerate(plain)], 1) * want).pow(2).sum().backward()
    torch.testing.assert_close(scale.grad, want.grad, rtol=1e-12, atol=1e-12)
    env.finalize()


@pytest.mark.parametrize("defer", [False, True])
def test_frozen_tables_train_the_dense_layers_on_every_rank(defer: bool) -> None:
    # a rank holding no table ran the backward exchange, the holder (frozen lookups) did not:
    # blocking, the first timed out in it; deferred, the holder's landing raised
    run_ranks(2, body_frozen_tables, defer, timeout=40)


def body_plans_differ() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    specs = (TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2))
    mine = ShardingPlan(tables=specs, owners=(env.rank, 1 - env.rank), ranks=2)  # both hold 0
    with pytest.raises(ValueError, match=r"the ranks called different collectives .*"
                                         r"owners \(0, 1\).*owners \(1, 0\)"):
        EmbeddingCollection(specs, dist, plan=mine)
    env.finalize()


def test_ranks_with_different_plans_are_refused() -> None:
    # rank 0 sent table 1's ids to rank 1, which answered them with rows of its table 0
    run_ranks(2, body_plans_differ, timeout=40)


def body_accumulate_into_a_block_without_ids() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2).double() for r in (4, 3)]
    # rank 1 holds rows 2..3 of table 0, then table 1, in one batched weight
    plan = ShardingPlan(tables=(TableSpec(rows=4, dim=2), TableSpec(rows=3, dim=2)),
                        owners=(ROW_WISE, 1), ranks=2, element_size=8)
    ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan)
    # the first batch asks for none of rank 1's rows of table 0; no step in between
    batches = [[torch.tensor([[0, 2], [1, 0]]), torch.tensor([[1, 1]])],
               [torch.tensor([[3, 2]]), torch.tensor([[2, 1], [0, 0]])]]
    for step in batches:
        ec(step[env.rank]).pow(2).sum().backward()
        for ids in step:
            (sum(e(ids[:, t]).pow(2).sum() for t, e in enumerate(plain)) / 2).backward()
    for t in ec.held():
        first, count = plan.rows_of(t, env.rank)
        torch.testing.assert_close(ec.get_submodule(str(t)).weight.grad.to_dense(),
                                   plain[t].weight.grad[first: first + count],
                                   rtol=1e-12, atol=1e-12, msg=lambda m, t=t: f"table {t}: {m}")
    env.finalize()


def test_gradients_accumulate_into_a_block_that_got_no_ids_before() -> None:
    # its empty sparse gradient was a view into the buffer of the next table's: the second
    # backward grew it in place, over that table's gradient (rank 1: table 1 wrong)
    run_ranks(2, body_accumulate_into_a_block_without_ids, timeout=40)


def body_empty_batch_with_split_tables() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2).double() for r in (4, 3, 5)]
    plan = ShardingPlan(tables=tuple(TableSpec(rows=r, dim=2) for r in (4, 3, 5)),
                        owners=(ROW_WISE, COLUMN_WISE, 0), ranks=3, element_size=8)
    ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan)
    batches = [torch.tensor([[3, 2, 4], [0, 0, 1]]), torch.zeros(0, 3, dtype=torch.long),
               torch.tensor([[1, 1, 0]])]  # rank 1 has no samples this step
    out = ec(batches[env.rank])
    want = torch.stack([e(batches[env.rank][:, t]) for t, e in enumerate(plain)], 1)
    assert out.shape == (len(batches[env.rank]), 3, 2) and torch.equal(out, want)
    out.pow(2).sum().backward()
    for ids in batches:
        (sum(e(ids[:, t]).pow(2).sum() for t, e in enumerate(plain)) / 3).backward()
    for t in ec.held():
        first, count = plan.rows_of(t, env.rank)
        column, width = plan.cols_of(t, env.rank)
        grad = ec.get_submodule(str(t)).weight.grad
        want = plain[t].weight.grad[first: first + count, column: column + width]
        torch.testing.assert_close(torch.zeros_like(want) if grad is None else grad.to_dense(),
                                   want, rtol=1e-12, atol=1e-12)
    env.finalize()


def test_a_rank_with_an_empty_batch_takes_part_with_split_tables() -> None:
    # its gather viewed 0 rows as (0, -1, dim) and raised; the others waited for it in the
    # rows' exchange until its exit was noticed
    run_ranks(3, body_empty_batch_with_split_tables, timeout=40)


def body_converted_after_construction() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, 2) for r in (5, 4)]
    plan = ShardingPlan(tables=(TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2)),
                        owners=(0, 0), ranks=2)  # rank 1 holds no table
    ec = EmbeddingCollection.from_embeddings(plain, dist, plan=plan).double()
    ids = torch.tensor([[env.rank, 2], [4, 3]])
    out = ec(ids)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.stack([e(ids[:, t]) for t, e in enumerate(plain)],
                                                1).double())
    state = ec.full_state()
    assert all(torch.equal(state[f"{t}.weight"], e.weight.detach().double())
               for t, e in enumerate(plain))
    env.finalize()


def test_a_rank_holding_no_table_follows_a_conversion_of_the_tables() -> None:
    # it looked up and received in the dtype of construction, the holders in float64: the
    # exchanges mismatched (a ValueError under the consistency check; without it, gloo aborted)
    run_ranks(2, body_converted_after_construction, timeout=40)


def _two_tables() -> tuple[Any, torch.nn.Module]:
    """The job's environment and a module holding two tables: table 0 split by rows over
    both ranks, table 1 on rank 1."""
    env = scaleout.init(timeout=20)
    plan = ShardingPlan(tables=(TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2)),
                        owners=(ROW_WISE, 1), ranks=2)
    net = torch.nn.Module()
    net.embeddings = EmbeddingCollection(plan.tables, env.create_distribution(), plan=plan)
    return env, net


def body_load_checks_table_shapes() -> None:
    env, net = _two_tables()
    state = full_state_dict(net)
    wider = {**state, "embeddings.0.weight": torch.randn(7, 2)}  # a larger vocabulary's
    with pytest.raises(ValueError, match=r"table 0 needs a full weight of shape \(5, 2\), "
                                         r"got \(7, 2\)"):
        load_full_state_dict(net, wider)
    load_full_state_dict(net, state)
    env.finalize()


def test_loading_a_table_of_another_shape_is_refused() -> None:
    # each rank sliced its rows out of the larger table, which loaded without complaint
    run_ranks(2, body_load_checks_table_shapes, timeout=40)


def body_load_without_tables() -> list[str]:
    env, net = _two_tables()
    net.fc = torch.nn.Linear(2, 1)
    dense = {k: v for k, v in full_state_dict(net).items() if k.startswith("fc.")}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: '
                                           r'"embeddings\.0\.weight"'):
        load_full_state_dict(net, dense)
    missing = load_full_state_dict(net, dense, strict=False).missing_keys
    env.finalize()
    return missing


def test_tables_missing_from_a_state_are_reported_like_torchs_missing_keys() -> None:
    """A KeyError before: each rank reports the tables it holds (table 0 is split by rows
    over both ranks, rank 1 holds table 1)."""
    assert run_ranks(2, body_load_without_tables, timeout=40) == [
        ["embeddings.0.weight"], ["embeddings.0.weight", "embeddings.1.weight"]]


def body_embedding_options() -> None:
    env = scaleout.init(timeout=20)
    dist = env.create_distribution()
    for option in ({"padding_idx": 0}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}):
        tables = [torch.nn.Embedding(5, 2), torch.nn.Embedding(4, 2, **option)]
        with pytest.raises(ValueError, match=rf"table 1: {next(iter(option))} .*not supported"):
            EmbeddingCollection.from_embeddings(tables, dist)
    # a frozen table was sharded trainable: an optimizer over the collection moved it
    pretrained = torch.nn.Embedding.from_pretrained(torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"tables \[1\] are frozen \(requires_grad=False\) "
                                         r"and the others are not"):
        EmbeddingCollection.from_embeddings([torch.nn.Embedding(5, 2), pretrained], dist)
    frozen = EmbeddingCollection.from_embeddings([pretrained, pretrained], dist)
    assert not any(p.requires_grad for p in frozen.parameters())
    # an owner of 0.5 was in range, no rank's: that table's lookups read zeros
    specs = (TableSpec(rows=5, dim=2), TableSpec(rows=4, dim=2))
    with pytest.raises(ValueError, match=r"owners must be ranks 0..1, ROW_WISE or "
                                         r"COLUMN_WISE, got \[0.5\]"):
        ShardingPlan(tables=specs, owners=(0.5, 1), ranks=2)
    for pooling in (float("nan"), True):
        with pytest.raises(ValueError, match="pooling must be a finite number > 0"):
            TableSpec(rows=5, dim=2, pooling=pooling)
    env.finalize()


def test_embeddings_with_options_the_tables_ignore_are_refused() -> None:
    # they were sharded without them: the padding row trained, say, silently
    run_ranks(2, body_embedding_options, timeout=30)
