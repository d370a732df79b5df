"""Exactness: N-rank DataParallel + DistributedOptimizer equals single-process training.

The reference runs in the same process on the whole global batch: per rank shard (and per
micro-batch) forward, losses averaged, one optimizer step — which for a model without
BatchNorm is exactly training on the concatenated batch, and with BatchNorm is what data
parallelism means (statistics per rank, as with DDP). Float64 and a tight tolerance, so any
logic error shows far above float reordering.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout import SchedulerConfig
from scaleout.pytorch import DataParallel, DistributedOptimizer, optimizer_state_bytes
from scaleout.pytorch.sharded_update import ELEMENTWISE

TINY = dict(bucket_bytes=4096, first_bucket_bytes=1024, partition_bytes=1024, credit_bytes=2048,
            urgent_bytes=600)
SCHEDULERS = {"fifo": SchedulerConfig(policy="fifo", **TINY),
              "priority": SchedulerConfig(policy="priority", **TINY),
              # buckets alternate between communicators, several on the wire at once
              "fifo-2-channels": SchedulerConfig(policy="fifo", channels=2, **TINY),
              "priority-3-channels": SchedulerConfig(policy="priority", channels=3, **TINY)}
PER_RANK, STEPS = 4, 6


class Net(nn.Module):
    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.conv.bias.requires_grad_(False)  # frozen
        self.bn = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.fc1 = nn.Linear(4 * 8 * 8, 32)
        self.extra = nn.Linear(32, 32)  # used in some iterations, on some ranks
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        h = F.relu(self.fc1(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(PER_RANK * world, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (PER_RANK * world,), generator=g)


def uses_extra(step: int, rank: int) -> bool:
    return (step % 3 == 1) or (step % 3 == 2 and rank == 0)


def make(opt_name: str, model: nn.Module) -> torch.optim.Optimizer:
    if opt_name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)


def losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, flag: bool, micro: int):
    for part_x, part_y in zip(x.chunk(micro), y.chunk(micro)):
        yield F.cross_entropy(model(part_x, flag), part_y) / micro


def reference(opt_name: str, world: int, batchnorm: bool, micro: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(batchnorm).double()
    opt = make(opt_name, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step, world)
        for rank in range(world):
            rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            for loss in losses(model, x[rows], y[rows], uses_extra(step, rank), micro):
                (loss / world).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def body_exact(*case: object) -> int:
    """``exact(env, *case)`` in a job of its own."""
    env = scaleout.init(timeout=60)
    state = exact(env, *case)  # type: ignore[arg-type]
    env.finalize()
    return state


def body_exact_cases(cases: list[tuple]) -> list[int]:
    """``exact`` of each case in turn, in one job (its start-up costs more than a case)."""
    env = scaleout.init(timeout=60)
    states = [exact(env, *case) for case in cases]
    env.finalize()
    return states


def exact(env: scaleout.Environment, opt_name: str, policy: str, mode: str, batchnorm: bool,
          micro: int, sharded: bool) -> int:
    """Train on this rank's part, check against the single-process reference; the optimizer
    state's bytes on this rank."""
    world = env.world_size
    torch.manual_seed(env.rank)  # different init per rank: DataParallel broadcasts rank 0's
    net = Net(batchnorm).double()
    if env.rank == 0:
        torch.manual_seed(0)
        net = Net(batchnorm).double()
    model = DataParallel(net, env.create_distribution(), scheduler=SCHEDULERS[policy],
                         distributed_update=sharded)
    opt = DistributedOptimizer(make(opt_name, net), model, mode=mode)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step, world)
        rows = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
        parts = list(losses(model, x[rows], y[rows], uses_extra(step, env.rank), 1))
        del parts  # (generator above used only to share code; run micro-batches below)
        xs, ys = x[rows].chunk(micro), y[rows].chunk(micro)
        for i, (px, py) in enumerate(zip(xs, ys)):
            loss = F.cross_entropy(model(px, uses_extra(step, env.rank)), py) / micro
            if i < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model.synchronize()
    expected = reference(opt_name, world, batchnorm, micro)
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-9, atol=1e-11,
                                   msg=lambda m, n=name: f"rank {env.rank} {n}: {m}")
    assert torch.equal(net.conv.bias, expected["conv.bias"])  # frozen: untouched
    if batchnorm:  # buffers agree on every rank
        flat = torch.cat([net.bn.running_mean, net.bn.running_var])
        gathered = model.distribution.allgather(flat, group=scaleout.GroupType.DATA).wait()
        for other in gathered.view(world, -1):
            torch.testing.assert_close(other, flat)
    state = optimizer_state_bytes(opt.inner)
    model.close()
    return state


CASES = [(opt, pol, mode) for opt in ("sgd", "adamw") for pol in ("fifo", "priority")
         for mode in ("sync", "overlap")]


@pytest.mark.parametrize("world", [2, 3])
def test_matches_single_process(world: int) -> None:  # every case of CASES
    run_ranks(world, body_exact_cases, [(*case, True, 1, False) for case in CASES],
              timeout=120)


@pytest.mark.parametrize("world", [2, 3])
def test_channels_match_single_process(world: int) -> None:
    run_ranks(world, body_exact_cases, [("adamw", policy, "overlap", True, 1, False)
                                        for policy in ("fifo-2-channels", "priority-3-channels")],
              timeout=120)


def test_micro_batch_accumulation() -> None:
    run_ranks(2, body_exact_cases, [("sgd", "priority", mode, False, 2, False)
                                    for mode in ("sync", "overlap")], timeout=120)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_update_matches_and_shrinks_state(world: int, opt_name: str) -> None:
    states = run_ranks(world, body_exact_cases, [(opt_name, "priority", "overlap", True, 1,
                                                  sharded) for sharded in (True, False)],
                       timeout=120)
    sharded, full = [state[0] for state in states], [state[1] for state in states]
    # every rank keeps state for about 1/world of the parameters
    for state in sharded:
        assert state <= full[0] / world * 1.2 + 64, (sharded, full)


#: torch's elementwise optimizers, with options that reach their per-element branches
SHARDABLE = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01, weight_decay=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.1,
                                         decoupled_weight_decay=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),  # (rectified from its 6th step)
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}


def body_elementwise() -> tuple[dict[str, float], str]:
    """Each of :data:`SHARDABLE` with the sharded update against one process (the slices are
    uneven at 3 ranks: 35 and 7 values); and Adafactor, refused."""
    env = scaleout.init(timeout=60)
    world, rank = env.world_size, env.rank
    worst = {}
    for i, (name, make_opt) in enumerate(SHARDABLE.items()):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()
        model = DataParallel(net, env.create_distribution(), distributed_update=True)
        opt = DistributedOptimizer(make_opt(net.parameters()), model,
                                   mode=("sync", "overlap")[i % 2])
        ref_opt = make_opt(ref.parameters())
        for step in range(6):
            x = torch.randn(3 * world, 5, generator=torch.Generator().manual_seed(step),
                            dtype=torch.float64)
            model(x[3 * rank: 3 * rank + 3]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            for part in x.chunk(world):
                (ref(part).pow(2).mean() / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        model.synchronize()
        worst[name] = max((p - q).abs().max().item()
                          for p, q in zip(net.parameters(), ref.parameters()))
        model.close()
    net = nn.Linear(4, 2)
    model = DataParallel(net, env.create_distribution(), distributed_update=True)
    try:
        DistributedOptimizer(torch.optim.Adafactor(net.parameters()), model)
        refused = "ok"
    except ValueError as err:
        refused = str(err)
    model.close()
    env.finalize()
    return worst, refused


def test_the_sharded_update_takes_torchs_elementwise_optimizers_only() -> None:
    """The sharded update steps flat slices: Adafactor's factored second moment became an
    unfactored one there and the weights differed (3.6e-3), silently."""
    assert set(SHARDABLE) == {kind.__name__ for kind in ELEMENTWISE}
    for worst, refused in run_ranks(3, body_elementwise, timeout=120):
        assert max(worst.values()) < 1e-12, worst
        assert "got Adafactor" in refused and "SGD, Adam, AdamW" in refused, refused


@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_lone_rank_matches_single_process(mode: str, fast: str) -> None:
    """World size 1: DataParallel steps aside (no hooks, no session) unless told not to
    (``SCALEOUT_ALONE_FAST_PATH=0``); either way training equals the plain model's."""
    run_ranks(1, body_exact, "adamw", "priority", mode, True, 1, False, timeout=120,
              env={"SCALEOUT_ALONE_FAST_PATH": fast})
    (committed,) = run_ranks(1, body_alone, timeout=60, env={"SCALEOUT_ALONE_FAST_PATH": fast})
    assert committed == (fast == "0")


def body_alone() -> bool:
    env = scaleout.init(timeout=60)
    model = DataParallel(Net(False), env.create_distribution())
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    committed = model.session is not None
    assert committed or list(model.statistics.as_dict()) == ["total"], model.statistics.as_dict()
    assert model.module.fc2.weight.grad is not None
    with pytest.raises(RuntimeError, match="first forward"):
        model.register_comm_hook(None, lambda state, bucket: None)
    model.close()
    env.finalize()
    return committed


def body_one_step_per_bucket() -> list[int]:
    """Every gradient in one bucket: each overlap-mode update is one optimizer step (the wait
    for the first layer's gradients brings every layer's, so all are updated together)."""
    env = scaleout.init(timeout=60)
    torch.manual_seed(0)
    net = Net(False).double()
    whole = SchedulerConfig(policy="fifo", bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    model = DataParallel(net, env.create_distribution(), scheduler=whole)
    opt = DistributedOptimizer(make("sgd", net), model, mode="overlap")
    steps: list[int] = []
    apply_update = opt.apply_update

    def counted(*args: object) -> None:
        steps[-1] += 1
        apply_update(*args)

    opt.apply_update = counted  # type: ignore[method-assign]
    for step in range(STEPS):
        steps.append(0)  # the previous iteration's update runs in this forward
        x, y = batch(step, env.world_size)
        F.cross_entropy(model(x[:PER_RANK], True), y[:PER_RANK]).backward()
        opt.step()
        opt.zero_grad()
    steps.append(0)
    model.synchronize()
    model.close()
    env.finalize()
    return steps


def test_an_update_waiting_for_one_bucket_takes_one_step() -> None:
    for steps in run_ranks(2, body_one_step_per_bucket, timeout=60):
        assert steps == [0] + [1] * STEPS, steps


def body_buffers_after_conversion() -> list[float]:
    """BatchNorm's running statistics of a model converted to float64 after wrapping (its
    buffers replaced by ``.double()``); this rank's running mean after 3 training forwards."""
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model = DataParallel(net, env.create_distribution())
    net.double()
    for step in range(3):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(10 * step + env.rank),
                        dtype=torch.float64)
        model(x)
    model.synchronize()
    mean = net[1].running_mean.tolist()
    model.close()
    env.finalize()
    return mean


def test_buffers_replaced_after_wrapping_are_still_averaged() -> None:
    """The buffer average captured the tensors at construction, so after ``net.double()``
    it averaged the old ones and the ranks' statistics drifted apart silently."""
    first, second = run_ranks(2, body_buffers_after_conversion, timeout=60)
    assert first == second, (first, second)
