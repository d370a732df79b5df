"""The sharded-DLRM oracle shared by the embedding tests: a small DLRM, its batches, the
single-process reference training, and :func:`train_dlrm`, which trains the same model with
sharded tables on a grid (any layout, prefetching, deferral, update in backward) and compares
it with the reference (float64, rtol 1e-9 / atol 1e-11)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import scaleout
from scaleout import GroupType
from scaleout.pytorch import (
    COLUMN_WISE,
    ROW_WISE,
    DataParallel,
    DistributedOptimizer,
    EmbeddingCollection,
    FusedRowWiseAdagrad,
    FusedSGD,
    RowWiseAdagrad,
    ShardingPlan,
    TableSpec,
    full_state_dict,
    load_full_state_dict,
    plan_tables,
    prefetching,
    tensor_parallel,
)
from scaleout.workloads import DLRMConfig, DLRMInputs, DLRMWorkload

CONFIG = DLRMConfig(num_dense=4, table_sizes=(50, 30, 20, 10, 7, 5), embedding_dim=4,
                    bottom_mlp=(8,), top_mlp=(8,))
WORKLOAD = DLRMWorkload(config=CONFIG)
PER_RANK, STEPS = 4, 4


def global_batch(step: int, data_parts: int) -> tuple[DLRMInputs, torch.Tensor]:
    inputs, targets = WORKLOAD.make_batch(PER_RANK * data_parts, step, 3)
    return DLRMInputs(inputs.dense.double(), inputs.sparse), targets.double()


def shard(inputs: DLRMInputs, targets: torch.Tensor, d: int):
    rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
    return DLRMInputs(inputs.dense[rows], inputs.sparse[rows]), targets[rows]


def optimizers(net: torch.nn.Module) -> tuple[list, list]:
    tables = [p for n, p in net.named_parameters() if n.startswith("embeddings.")]
    dense = [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]
    return dense, tables


def table_optimizer(layout: str, tables: list) -> torch.optim.Optimizer:
    # RowWiseAdagrad's per-row statistic would cover each rank's columns only
    if layout == "columns":
        return torch.optim.SGD(tables, lr=0.5)
    return RowWiseAdagrad(tables, lr=0.05)


def fused_rule(layout: str) -> FusedSGD | FusedRowWiseAdagrad:
    """:func:`table_optimizer`'s update, applied in backward."""
    return FusedSGD(lr=0.5) if layout == "columns" else FusedRowWiseAdagrad(lr=0.05)


def reference(data_parts: int, layout: str) -> dict[str, torch.Tensor]:
    net = WORKLOAD.build_model(0).double()
    dense, tables = optimizers(net)
    dense_opt = torch.optim.SGD(dense, lr=0.1, momentum=0.9)
    table_opt = table_optimizer(layout, tables)
    for step in range(STEPS):
        inputs, targets = global_batch(step, data_parts)
        for d in range(data_parts):
            x, y = shard(inputs, targets, d)
            (F.binary_cross_entropy_with_logits(net(x), y) / data_parts).backward()
        dense_opt.step()
        table_opt.step()
        dense_opt.zero_grad()
        table_opt.zero_grad()
    return net.state_dict()


def body_dlrm(*case: object) -> list[int] | int:
    """:func:`train_dlrm` of ``case`` in a job of its own."""
    env = scaleout.init(timeout=60)
    held = train_dlrm(env, *case)  # type: ignore[arg-type]
    env.finalize()
    return held


def body_dlrm_cases(cases: list[tuple]) -> list[list[int] | int]:
    """:func:`train_dlrm` of each case in turn, in one job (its start-up costs about as much
    as a case)."""
    env = scaleout.init(timeout=60)
    held = [train_dlrm(env, *case) for case in cases]
    env.finalize()
    return held


def run_dlrm_cases(cases: list[tuple], timeout: float = 120) -> dict[tuple, list]:
    """Every case (``train_dlrm``'s arguments after ``env``), those of one world size in one
    job: by case, what each rank returned."""
    from harness import run_ranks

    worlds: dict[int, list[tuple]] = {}
    for case in cases:
        worlds.setdefault(case[0] * case[1], []).append(case)
    found = {}
    for world, some in worlds.items():
        ranks = run_ranks(world, body_dlrm_cases, some, timeout=timeout)
        found.update({case: [held[i] for held in ranks] for i, case in enumerate(some)})
    return found


def train_dlrm(env: scaleout.Environment, data_parts: int, model_parts: int, mode: str,
               layout: str, prefetch: str = "none", defer: str = "no", update: str = "step",
               ids: str = "two rounds") -> list[int] | int:
    """Train ``STEPS`` steps, compare with :func:`reference`; the tables held here (``defer
    == "late"``: how many weights differ). ``update == "backward"``: the tables are updated
    in backward (no table optimizer). ``ids == "one round"``: the collection is given
    ``max_batch``, so each batch's counts and ids travel together; ``"with gradients"``: and
    a prefetched batch's ids travel with the rows' gradients of the backward before it."""
    max_batch = PER_RANK if ids in ("one round", "with gradients") else None
    riding = ids == "with gradients"
    dist = env.create_distribution(data_parts, model_parts)
    net = WORKLOAD.build_model(0).double()
    specs = [TableSpec(rows=rows, dim=CONFIG.embedding_dim) for rows in CONFIG.table_sizes]
    if layout == "budget":  # 8-byte weights: the 50-row table (1600 bytes) fits no rank
        plan = plan_tables(specs, data_parts, memory_budget=1500, element_size=8)
        assert plan.owners[0] == ROW_WISE and plan.owners[1] != ROW_WISE
        assert max(map(plan.memory_of, range(data_parts))) <= 1500
    elif layout == "explicit":  # row-wise tables of 50 and of 5 rows, the others whole
        plan = ShardingPlan(tables=tuple(specs), owners=(ROW_WISE, 0, 1, 0, 1, ROW_WISE),
                            ranks=data_parts, element_size=8)
    elif layout == "columns":  # tables 1 and 4 split by columns, 0 by rows
        plan = ShardingPlan(tables=tuple(specs), owners=(ROW_WISE, COLUMN_WISE, 0, 1, COLUMN_WISE,
                                                         0), ranks=data_parts, element_size=8)
        assert "(columns 2+2)" in plan.describe() or data_parts != 2
    elif layout == "idle":  # the last rank holds no table: it only asks and answers nothing
        plan = ShardingPlan(tables=tuple(specs), owners=(0, 1, 0, 1, 0, 1), ranks=data_parts,
                            element_size=8)
    else:
        plan = plan_tables(specs, data_parts, element_size=8)
    # ids repeat within a rank's batch: the exchange sends each distinct one once
    x0, _ = shard(*global_batch(0, data_parts), dist.rank(GroupType.DATA))
    assert any(x0.sparse[:, t].unique().numel() < PER_RANK for t in range(len(specs)))
    net.embeddings = EmbeddingCollection.from_embeddings(list(net.embeddings), dist, plan=plan,
                                                         max_batch=max_batch,
                                                         ids_with_gradients=riding)
    if model_parts > 1:
        tensor_parallel(net, dist)
    dense, tables = optimizers(net)
    model = DataParallel(net, dist)
    dense_opt = DistributedOptimizer(torch.optim.SGD(dense, lr=0.1, momentum=0.9), model,
                                     mode=mode)
    table_opt = table_optimizer(layout, tables) if tables else None  # "idle": none held
    if update == "backward":
        net.embeddings.update_in_backward(fused_rule(layout))
        table_opt = None
    if prefetch == "loader":  # the next batch's rows leave once the tables are updated
        net.embeddings.look_up_after(table_opt or dense_opt)  # (a rank without tables: any)
    elif prefetch == "after backward":  # updated in backward: they leave at its end
        net.embeddings.look_up_after_backward()
    if defer == "step":  # the rows' gradients land in the tables' step pre-hook
        net.embeddings.defer_backward(table_opt or dense_opt)
    elif defer == "late":  # wrong on purpose: they land at the next forward, after the step
        net.embeddings.defer_backward(None)
    d = dist.rank(GroupType.DATA)
    batches = [shard(*global_batch(step, data_parts), d) for step in range(STEPS)]
    if prefetch in ("loader", "after backward"):  # each next batch's ids travel meanwhile
        batches = prefetching(batches, net.embeddings, ids=lambda batch: batch[0].sparse)
    elif prefetch == "two ahead":
        net.embeddings.prefetch(batches[0][0].sparse)
        net.embeddings.prefetch(batches[1][0].sparse)
    for step, (x, y) in enumerate(batches):
        if prefetch == "two ahead" and step + 2 < STEPS:
            net.embeddings.prefetch(batches[step + 2][0].sparse)
        if prefetch != "none":
            ahead = 2 if prefetch == "two ahead" else 1  # this batch's and those ahead
            assert net.embeddings.prefetched == min(ahead + 1, STEPS - step)
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        if riding and prefetch != "none" and step + 1 < STEPS:  # the next ids came along
            assert net.embeddings._pending[0].carried
        if defer != "no":  # backward returned before the tables' gradients came back
            assert all(p.grad is None for p in tables)
            # (unless the next lookup, at the end of backward, landed them to read the tables)
            last = prefetch == "after backward" and step + 1 == STEPS
            assert len(net.embeddings._landing) == (prefetch != "after backward" or last)
        assert all(p.grad is None or p.grad.is_sparse for p in tables)
        assert update == "step" or all(p.grad is None for p in tables)
        if prefetch == "after backward":  # the next batch's rows left before the step
            assert len(net.embeddings._started) == (step + 1 < STEPS)
        dense_opt.step()
        dense_opt.zero_grad()
        if table_opt is not None:
            table_opt.step()
            table_opt.zero_grad()
        if prefetch == "two ahead":
            assert net.embeddings.start_lookup() == (step + 1 < STEPS)
    model.synchronize()
    assert model.statistics.operation("embeddings (activations)").bytes > 0
    state = full_state_dict(net)
    expected = reference(data_parts, layout)
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    if defer == "late":  # how many weights the misordered update got wrong
        off = sum(not torch.allclose(state[n], v, rtol=1e-9, atol=1e-11)
                  for n, v in expected.items())
        net.embeddings.drain()
        model.close()
        return off
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {n}: {m}")
    held = net.embeddings.held()
    fresh = WORKLOAD.build_model(1).double()
    fresh.embeddings = EmbeddingCollection.from_embeddings(list(fresh.embeddings), dist,
                                                           plan=plan, max_batch=max_batch,
                                                           ids_with_gradients=riding)
    if model_parts > 1:
        tensor_parallel(fresh, dist)
    load_full_state_dict(fresh, expected)
    assert all(torch.equal(v, expected[k]) for k, v in full_state_dict(fresh).items())
    model.close()
    return held
