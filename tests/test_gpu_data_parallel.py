"""DataParallel on CUDA: exact like the single-process reference, every buffer on the GPU,
and buckets that wait for their gradients' kernels (streams), at world size 1 over NCCL and
2 over gloo with CUDA tensors (one GPU: NCCL refuses two ranks on one device).

Without CUDA these tests skip (the ``gpu`` marker; ``SCALEOUT_REQUIRE_GPU=1`` makes a skip a
failure). The reference runs on the CPU inside each rank, so the parent never touches CUDA
before it forks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer
from test_data_parallel import PER_RANK, SCHEDULERS, STEPS, Net, batch, make, reference, uses_extra

pytestmark = pytest.mark.gpu  # conftest: skip without CUDA, fail under SCALEOUT_REQUIRE_GPU=1

BACKEND = {1: "nccl", 2: "gloo"}


def body_exact(mode: str, sharded: bool, opt_name: str) -> None:
    env = scaleout.init(backend=BACKEND[int(os.environ["WORLD_SIZE"])], timeout=60)
    world = env.world_size
    torch.manual_seed(0)
    net = Net(batchnorm=True).double().cuda()
    model = DataParallel(net, env.create_distribution(), scheduler=SCHEDULERS["priority"],
                         distributed_update=sharded)
    opt = DistributedOptimizer(make(opt_name, net), model, mode=mode)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        x, y = batch(step, world)
        rows = slice(env.rank * PER_RANK, (env.rank + 1) * PER_RANK)
        loss = F.cross_entropy(model(x[rows].cuda(), uses_extra(step, env.rank)), y[rows].cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    model.synchronize()
    expected = reference(opt_name, world, True, 1)
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.detach().cpu(), expected[name], rtol=1e-7, atol=1e-9,
                                   msg=lambda m, n=name: f"rank {env.rank} {n}: {m}")
    on_cpu = [k for st in opt.inner.state.values() for k, v in st.items()
              if torch.is_tensor(v) and v.dim() > 0 and not v.is_cuda]
    assert not on_cpu, f"optimizer state on the CPU: {on_cpu}"
    if model.session is None:  # a lone rank's fast path: nothing set up, nothing to check
        assert world == 1 and os.environ.get("SCALEOUT_ALONE_FAST_PATH", "1") != "0"
    else:
        for bucket in model.session.buckets:
            assert bucket.buffer().is_cuda
        total = model.statistics.total()  # from CUDA events, read once they completed
        assert total.compute_s > 0 and (world == 1 or total.comm_s > 0), total
    model.close()
    env.finalize()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode,sharded,opt_name", [("overlap", False, "sgd"),
                                                   ("sync", False, "adamw"),
                                                   ("overlap", True, "adamw")])
def test_cuda_matches_single_process(world: int, mode: str, sharded: bool, opt_name: str) -> None:
    run_ranks(world, body_exact, mode, sharded, opt_name, timeout=180)
    if world == 1 and not sharded:  # the whole machinery too, which a lone rank skips
        run_ranks(1, body_exact, mode, sharded, opt_name, timeout=180,
                  env={"SCALEOUT_ALONE_FAST_PATH": "0"})


CODECS = ["cast:fp16", "cast:bf16", "blockquant", "sign", "topk:ratio=0.05", "powersgd:rank=2",
          "rows"]


def body_codec(spec: str) -> list[float]:
    env = scaleout.init(backend="gloo", timeout=60)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    model = DataParallel(net, env.create_distribution(), compression=spec)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), model)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.synchronize()
    for bucket in model.session.buckets:
        state = getattr(bucket.state, "codec_state", None)
        if state is None:
            continue
        tensors = {**state.buffers, **state.scratch}
        on_cpu = [k for k, v in tensors.items() if torch.is_tensor(v) and not v.is_cuda]
        assert not on_cpu, f"{spec}: codec state on the CPU: {on_cpu}"
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = model.distribution.allgather(weights, group=scaleout.GroupType.DATA).wait()
    assert torch.equal(gathered.view(env.world_size, -1)[0], weights)  # replicas agree
    model.close()
    env.finalize()
    return losses


@pytest.mark.parametrize("spec", CODECS)
def test_every_codec_trains_on_cuda_with_state_on_the_gpu(spec: str) -> None:
    losses = run_ranks(2, body_codec, spec, timeout=180)[0]
    assert losses[-1] < 0.7 * losses[0], losses


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps the GPU busy for a while."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the gradient below exists
        return grad * 1.0


class _SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_SlowBackward.apply(torch.tanh(self.fc1(x))))


def body_streams() -> None:
    env = scaleout.init(backend="gloo", timeout=60)
    torch.manual_seed(0)
    cpu = _SlowNet().double()
    net = _SlowNet().double().cuda()
    net.load_state_dict(cpu.state_dict())
    model = DataParallel(net, env.create_distribution())  # sync semantics: grads in .grad
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8 * env.world_size, 32, generator=g, dtype=torch.float64)
    for rank in range(env.world_size):  # the reference: the mean over every rank's shard
        (cpu(x[rank * 8:(rank + 1) * 8]).square().mean() / env.world_size).backward()
    mine = x[env.rank * 8:(env.rank + 1) * 8].cuda()
    model(mine).square().mean().backward()  # fc1's gradient is produced after the sleep
    for (name, p), ref in zip(net.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), ref.grad, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"rank {env.rank} {n}: {m}")
    model.close()
    env.finalize()


def test_a_bucket_waits_for_its_gradient_kernels() -> None:
    run_ranks(2, body_streams, timeout=120)
