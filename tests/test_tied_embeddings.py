"""Tied embeddings: the LM head's share of a tied weight's gradient leaves early, the lookup's
row-sparse, and training still equals the single-process reference on the whole batch.

Float64, the reference's tolerance: dropping or double-counting either share (or sending
the head's share where the lookup's belongs) moves the weights far above float reordering.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import SchedulerConfig
from scaleout.compression import CompressionConfig
from scaleout.pytorch import DataParallel, DistributedOptimizer


@pytest.fixture(autouse=True)
def _split_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split is opt-in (SCALEOUT_SPLIT_TIED=1); the forked ranks inherit this."""
    monkeypatch.setenv("SCALEOUT_SPLIT_TIED", "1")

VOCAB, SEQ, WIDTH, PER_RANK, STEPS = 40, 6, 8, 3, 5
TINY = SchedulerConfig(bucket_bytes=4096, first_bucket_bytes=1024, partition_bytes=1024,
                       credit_bytes=2048, urgent_bytes=600)


class TiedLM(nn.Module):
    """Token embedding, a hidden layer, a head tied to the embedding: functional (``F.linear``
    on the embedding's weight, as the bench's GPT) or a module sharing the Parameter (as
    Hugging Face's GPT-2). Only the first ``VOCAB // 2`` tokens occur, so the lookup's share
    is row-sparse."""

    def __init__(self, head_module: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False) if head_module else None
        if self.head is not None:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(ids)))
        return self.head(h) if self.head is not None else F.linear(h, self.emb.weight)


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB // 2, (PER_RANK * world, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def reference(world: int, head_module: bool, micro: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = TiedLM(head_module).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        ids, targets = batch(step, world)
        for rank in range(world):
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            for x, y in zip(ids[rows].chunk(micro), targets[rows].chunk(micro)):
                (loss_of(net, x, y) / (world * micro)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def body(*case: object) -> tuple[bool, list[bool]]:
    """``tied(env, *case)`` in a job of its own."""
    env = scaleout.init(timeout=60)
    result = tied(env, *case)  # type: ignore[arg-type]
    env.finalize()
    return result


def body_cases(cases: list[tuple]) -> list[tuple[bool, list[bool]]]:
    """``tied`` of each case in turn, in one job (its start-up costs more than a case)."""
    env = scaleout.init(timeout=60)
    results = [tied(env, *case) for case in cases]
    env.finalize()
    return results


def tied(env: scaleout.Environment, mode: str, head_module: bool, micro: int,
         options: dict) -> tuple[bool, list[bool]]:
    """Train, check against the reference; whether the weight was split, and by step
    whether its early share was on its way when the lookup's arrived."""
    world = env.world_size
    torch.manual_seed(0 if env.rank == 0 else 7)  # DataParallel broadcasts rank 0's weights
    net = TiedLM(head_module).double()
    model = DataParallel(net, env.create_distribution(), scheduler=TINY, **options)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
                               model, mode=mode)
    early_first: list[bool] = []  # the early share was on its way when the lookup's arrived

    def lookup_arrived(_param: nn.Parameter) -> None:
        layer = model.layers[0]
        if layer.early:
            early_first.append(layer.early[0].gradient_pending)
    net.emb.weight.register_post_accumulate_grad_hook(lookup_arrived)
    for step in range(STEPS):
        ids, targets = batch(step, world)
        rows = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
        parts = list(zip(ids[rows].chunk(micro), targets[rows].chunk(micro)))
        for i, (x, y) in enumerate(parts):
            loss = loss_of(model, x, y) / micro
            if i < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if mode == "sync" and step == 0:  # .grad holds the whole averaged gradient
            assert net.emb.weight.grad is not None and net.emb.weight.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
    model.synchronize()
    expected = reference(world, head_module, micro)
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {n}: {m}")
    split = bool(model.layers[0].early)
    model.close()
    return split, early_first


@pytest.mark.parametrize("world", [2, 3])
def test_tied_weight_split_matches_single_process(world: int) -> None:
    """Sync and overlap mode, the head a function of the weight or a module, in one job."""
    cases = [(mode, head_module, 1, {}) for mode in ("sync", "overlap")
             for head_module in (False, True)]
    for results in run_ranks(world, body_cases, cases, timeout=120):
        for case, (split, early_first) in zip(cases, results):
            assert split, case  # the tied weight travels in two shares
            assert early_first == [True] * STEPS, case  # the head's share left first


def test_tied_weight_split_with_micro_batches() -> None:
    """Under ``no_sync()`` the head's share stays in ``.grad`` and travels with the lookup's."""
    for split, early_first in run_ranks(2, body, "overlap", False, 2, {}, timeout=120):
        assert split and early_first[-1]


@pytest.mark.parametrize("options", [{"compression": CompressionConfig(codec="cast:bf16",
                                                                      min_numel=0)},
                                     {"distributed_update": True}],
                         ids=["compressed", "sharded"])
def test_tied_weight_not_split_when_not_exact_allreduce(options: dict) -> None:
    """A codec or the sharded update takes the weight whole: one share, still trained right
    (the codec's case within its tolerance: bf16 is checked only for running)."""
    if "compression" in options:
        results = run_ranks(2, body_unsplit, options, timeout=120)
    else:
        results = run_ranks(2, body, "overlap", False, 1, options, timeout=120)
    assert all(not split for split, _ in results)


@pytest.mark.parametrize("value", ["0", None])
def test_tied_weight_split_is_off_unless_turned_on(value: str | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``SCALEOUT_SPLIT_TIED=0`` or unset (the default): the weight travels whole, training
    still exact."""
    if value is None:
        monkeypatch.delenv("SCALEOUT_SPLIT_TIED")
    results = run_ranks(2, body, "overlap", False, 1, {}, timeout=120,
                        env={} if value is None else {"SCALEOUT_SPLIT_TIED": value})
    assert all(not split and not early_first for split, early_first in results)


def body_unsplit(options: dict) -> tuple[bool, list[bool]]:
    env = scaleout.init(timeout=60)
    torch.manual_seed(0)
    net = TiedLM(False)
    model = DataParallel(net, env.create_distribution(), scheduler=TINY, **options)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), model)
    for step in range(2):
        ids, targets = batch(step, env.world_size)
        loss_of(model, ids, targets).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    split = bool(model.layers[0].early)
    model.close()
    env.finalize()
    return split, []
