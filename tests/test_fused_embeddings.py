"""Tables updated in backward (``EmbeddingCollection.update_in_backward``): the same weights
as the optimizer step on the sparse gradients, the next lookup at the end of backward, the
rules' checks, and the rule's state in checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scaleout
from dlrm_oracle import CONFIG, WORKLOAD, body_dlrm, global_batch, shard
from harness import run_ranks
from scaleout import GroupType, checkpoint
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
)
from scaleout.pytorch.embeddings.batched import TableBatch


@pytest.mark.parametrize("data_parts,model_parts,mode,layout,prefetch,defer", [
    (2, 1, "overlap", "planned", "loader", "no"), (3, 1, "sync", "budget", "two ahead", "no"),
    (2, 2, "overlap", "columns", "loader", "no"), (3, 1, "overlap", "idle", "loader", "step"),
    (2, 1, "overlap", "explicit", "none", "step"),
    # the next batch's rows leave at the end of backward, before the optimizer steps
    (2, 1, "overlap", "planned", "after backward", "no"),
    (3, 1, "sync", "columns", "after backward", "no"),
    (3, 1, "overlap", "idle", "after backward", "step")])
def test_tables_updated_in_backward_match_single_process(data_parts: int, model_parts: int,
                                                         mode: str, layout: str, prefetch: str,
                                                         defer: str) -> None:
    # one update of a rank's tables in the lookups' backward: the optimizer step's weights
    held = run_ranks(data_parts * model_parts, body_dlrm, data_parts, model_parts, mode, layout,
                     prefetch, defer, "backward", timeout=120)
    assert set(t for h in held for t in h) == set(range(len(CONFIG.table_sizes)))


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_fused_update_equals_the_optimizer_step_on_the_sparse_gradients(rule: str) -> None:
    # a row-wise table's block (ids outside it asked too), a whole table; rows asked twice
    blocks, rows = [(3, 5), (0, 4)], [9, 4]
    batches = [TableBatch(blocks, rows, dim=3, dtype=torch.float64) for _ in range(2)]
    start = torch.randn(9, 3, dtype=torch.float64)
    members = []
    for batch in batches:
        weights = [torch.nn.Parameter(batch.view(j)) for j in batch.members]
        for w, j in zip(weights, batch.members):
            w.data = batch.view(j)
        batch.weight.copy_(start)
        members.append(weights)
    fused = FusedSGD(lr=0.3) if rule == "sgd" else FusedRowWiseAdagrad(lr=0.3)
    batches[0].update = fused
    stepped = members[1]
    opt = (torch.optim.SGD(stepped, lr=0.3) if rule == "sgd"
           else RowWiseAdagrad(stepped, lr=0.3))
    table = torch.tensor([0, 0, 1, 0, 1, 0])
    for step in range(3):
        ids = torch.tensor([4, 2, 1, 4, 1, 7 - step])  # 2 is not my row of table 0
        grad = torch.randn(6, 3, dtype=torch.float64)
        for batch, weights in zip(batches, members):
            batch.look_up(batch.rows(ids, table), table, weights).backward(grad)
        assert all(w.grad is None for w in members[0])  # updated in backward, no .grad
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(batches[0].weight, batches[1].weight, rtol=1e-12, atol=0)
    assert not torch.equal(batches[0].weight, start)
    if rule == "adagrad":  # the batched weight's accumulators, one per row
        assert fused.state_dict()["state"]["batch"].shape == (9,)
        again = FusedRowWiseAdagrad(lr=1.0)
        again.load_state_dict(fused.state_dict())
        assert again.lr == 0.3 and torch.equal(again.state["batch"], fused.state["batch"])


def test_fused_rules_check_their_arguments() -> None:
    with pytest.raises(ValueError, match="FusedSGD: lr must be > 0, got 0"):
        FusedSGD(lr=0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        FusedRowWiseAdagrad(lr=0.1, eps=-1.0)
    with pytest.raises(TypeError, match="lr must be a number, got str"):
        FusedSGD(lr="0.1")  # type: ignore[arg-type]


def body_fused_checkpoint(path: str) -> None:
    """Row-wise Adagrad in backward: its accumulators, held by no optimizer, are checkpointed
    with the collection; a resumed run equals an uninterrupted one."""
    env = scaleout.init(timeout=60)
    dist = env.create_distribution()
    d = dist.rank(GroupType.DATA)

    def build(seed: int) -> tuple[torch.nn.Module, DataParallel, torch.optim.Optimizer]:
        net = WORKLOAD.build_model(seed).double()
        net.embeddings = EmbeddingCollection.from_embeddings(list(net.embeddings), dist)
        net.embeddings.update_in_backward(FusedRowWiseAdagrad(lr=0.05))
        model = DataParallel(net, dist)
        dense = [p for n, p in net.named_parameters() if not n.startswith("embeddings.")]
        return net, model, DistributedOptimizer(torch.optim.SGD(dense, lr=0.1, momentum=0.9),
                                                model)

    def train(model: DataParallel, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x, y = shard(*global_batch(step, 2), d)
            F.binary_cross_entropy_with_logits(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.synchronize()

    net, model, opt = build(0)
    train(model, opt, range(2))
    checkpoint.save(path, model, opt, step=2)
    train(model, opt, range(2, 4))
    # resumed from the checkpoint into other initial weights: the same weights after step 4
    fresh, fresh_model, fresh_opt = build(1)
    checkpoint.load(path, fresh_model, fresh_opt)
    train(fresh_model, fresh_opt, range(2, 4))
    for name, value in net.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=1e-12, atol=0)
    # without the rule's accumulators (a fresh rule, its state not loaded) they differ
    reset, reset_model, reset_opt = build(1)
    checkpoint.load(path, reset_model, reset_opt)
    reset.embeddings._batch.update.state.clear()
    train(reset_model, reset_opt, range(2, 4))
    assert any(not torch.allclose(reset.state_dict()[n], v) for n, v in net.state_dict().items()
               if n.startswith("embeddings.") and not n.endswith("_extra_state"))
    # loading it where the tables are not updated in backward is refused, naming the rule
    plain = WORKLOAD.build_model(0).double()
    plain.embeddings = EmbeddingCollection.from_embeddings(list(plain.embeddings), dist)
    with pytest.raises(ValueError, match=r"updated in backward by FusedRowWiseAdagrad when "
                       r"saved, here by none: call update_in_backward"):
        plain.load_state_dict(model.module_state_dict())
    for m in (model, fresh_model, reset_model):
        m.close()
    env.finalize()


def test_a_checkpoint_keeps_the_state_of_the_update_in_backward(tmp_path) -> None:
    run_ranks(2, body_fused_checkpoint, str(tmp_path / "ckpt"), timeout=120)


def body_update_in_backward_api() -> None:
    env = scaleout.init(timeout=60)
    ec = EmbeddingCollection([TableSpec(rows=r, dim=2) for r in (5, 4, 3)],
                             env.create_distribution(),
                             plan=ShardingPlan(tables=tuple(TableSpec(rows=r, dim=2)
                                                            for r in (5, 4, 3)),
                                               owners=(0, COLUMN_WISE, ROW_WISE), ranks=2,
                                               element_size=4))
    with pytest.raises(TypeError, match="expected FusedSGD or FusedRowWiseAdagrad, got SGD"):
        ec.update_in_backward(torch.optim.SGD(ec.parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not updated in backward"):
        ec.look_up_after_backward()  # the tables would be read before their step
    handle = ec.update_in_backward(FusedSGD(lr=0.1))
    with pytest.raises(RuntimeError, match="updated in backward already"):
        ec.update_in_backward(FusedSGD(lr=0.1))
    ids = torch.tensor([[1, 2, 0], [4, 3, 2]])
    before = {n: p.detach().clone() for n, p in ec.named_parameters()}
    ec(ids).sum().backward()
    assert all(p.grad is None for p in ec.parameters())  # the column block's hook too
    assert all(not torch.equal(p, before[n]) for n, p in ec.named_parameters())
    after = ec.look_up_after_backward()
    ec.prefetch(ids)
    ec.prefetch(ids)
    ec(ids).sum().backward()
    assert len(ec._started) == 1  # the second batch's rows left at the end of backward
    ec(ids).sum().backward()
    assert not ec._started and not ec.prefetched
    handle.remove()  # sparse .grad again, for an optimizer
    ec.prefetch(ids)
    with pytest.raises(RuntimeError, match="update_in_backward was removed"):
        ec(ids).sum().backward()
    after.remove()
    ec.drain()
    for p in ec.parameters():
        p.grad = None
    ec(ids).sum().backward()
    assert all(p.grad is not None and p.grad.is_sparse for p in ec.parameters())
    env.finalize()


def test_update_in_backward_checks_its_rule_and_can_be_removed() -> None:
    run_ranks(2, body_update_in_backward_api, timeout=60)
