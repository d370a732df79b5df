"""The sharded tables on every device: an ``EmbeddingCollection`` moved with ``.to(device)``
trains like plain tables on one process (rows updated in backward, each batch's ids in one
round with the rows' gradients before it, the next rows looked up at the end of backward),
with its weights and the ids' routing on that device.

The CPU cases run everywhere; the CUDA ones carry the ``gpu`` marker (conftest: skip
without CUDA, fail under ``SCALEOUT_REQUIRE_GPU=1``): world size 1 over NCCL, 2 over gloo
with CUDA tensors (one GPU: NCCL refuses two ranks on one device). The reference runs on the
CPU inside each rank, so the parent never touches CUDA before it forks.
"""

from __future__ import annotations

import pytest
import torch

import scaleout
from harness import run_ranks
from scaleout.pytorch import (
    COLUMN_WISE,
    ROW_WISE,
    EmbeddingCollection,
    FusedSGD,
    ShardingPlan,
    TableSpec,
    prefetching,
)

ROWS, DIM, PER_RANK, STEPS, LR = (7, 3, 5, 4), 4, 3, 4, 0.3
WEIGHTS = torch.arange(1, len(ROWS) * DIM + 1, dtype=torch.float64).view(len(ROWS), DIM) / 10


def _batches(world: int) -> list[torch.Tensor]:
    """Every step's ids for all ranks, ``(world * PER_RANK, tables)`` (ids repeat)."""
    generator = torch.Generator().manual_seed(7)
    return [torch.stack([torch.randint(0, r, (world * PER_RANK,), generator=generator)
                         for r in ROWS], 1) for _ in range(STEPS)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A rank's loss; the group's is their mean (the collection averages the tables'
    gradients over the data group, as DataParallel does)."""
    return (out * WEIGHTS.to(out)).pow(2).sum()


def _reference(world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, DIM, dtype=torch.float64) for r in ROWS]
    opt = torch.optim.SGD([t.weight for t in plain], lr=LR)
    for ids in _batches(world):
        out = torch.stack([t(ids[:, j]) for j, t in enumerate(plain)], 1)
        (out * WEIGHTS).pow(2).sum().div(world).backward()
        opt.step()
        opt.zero_grad()
    return [t.weight.detach() for t in plain]


def body_devices(device: str, backend: str) -> None:
    env = scaleout.init(backend=backend, timeout=60)
    world, rank = env.world_size, env.rank
    torch.manual_seed(0)
    plain = [torch.nn.Embedding(r, DIM, dtype=torch.float64) for r in ROWS]
    plan = ShardingPlan(tables=tuple(TableSpec(rows=r, dim=DIM) for r in ROWS),
                        owners=(ROW_WISE, COLUMN_WISE, 0, world - 1), ranks=world,
                        element_size=8)
    ec = EmbeddingCollection.from_embeddings(plain, env.create_distribution(), plan=plan,
                                             max_batch=PER_RANK, ids_with_gradients=True)
    ec.to(device)
    ec.update_in_backward(FusedSGD(lr=LR))
    ec.look_up_after_backward()
    mine = [ids[rank * PER_RANK: (rank + 1) * PER_RANK].to(device) for ids in _batches(world)]
    for step, ids in enumerate(prefetching(mine, ec, ids=lambda batch: batch)):
        out = ec(ids)
        assert out.device.type == device and out.shape == (PER_RANK, len(ROWS), DIM)
        _loss(out).backward()
        if step + 1 < STEPS:  # the next batch's ids came with these gradients
            assert ec._pending[0].carried
    held = [p for p in ec.parameters()]
    assert held and all(p.device.type == device for p in held)
    state = ec.full_state()
    for t, expected in enumerate(_reference(world)):
        torch.testing.assert_close(state[f"{t}.weight"].cpu(), expected, rtol=1e-9, atol=1e-11,
                                   msg=lambda m, t=t: f"rank {rank} table {t}: {m}")
    env.finalize()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_tables_train_like_one_process_on_the_cpu(world: int) -> None:
    run_ranks(world, body_devices, "cpu", "gloo", timeout=60)


@pytest.mark.gpu
@pytest.mark.parametrize("world,backend", [(1, "nccl"), (2, "gloo")])
def test_sharded_tables_train_like_one_process_on_cuda(world: int, backend: str) -> None:
    run_ranks(world, body_devices, "cuda", backend, timeout=120)
