"""scaleout.horovod on CUDA tensors: 2 ranks sharing one GPU over gloo, 1 rank over NCCL.

Skipped without CUDA. (Two NCCL ranks need two GPUs; the face code is the same.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleout.horovod as hvd
from harness import run_ranks

pytestmark = pytest.mark.gpu  # conftest: skip without CUDA, fail under SCALEOUT_REQUIRE_GPU=1


def body(backend: str | None) -> dict[str, object]:
    hvd.init(timeout=60, backend=backend)
    r, n = hvd.rank(), hvd.size()
    dev = torch.device("cuda", 0)
    x = torch.full((4,), float(r + 1), device=dev)
    total = n * (n + 1) / 2
    assert hvd.allreduce(x, op=hvd.Sum).tolist() == [total] * 4
    assert hvd.allreduce(x).tolist() == [total / n] * 4
    assert hvd.allreduce(x, compression=hvd.Compression.fp16).dtype == torch.float32
    assert hvd.allgather(x[: r + 1]).numel() == total
    assert hvd.broadcast(x, 0).tolist() == [1.0] * 4
    assert hvd.allreduce(x, op=hvd.Product).device == dev
    y = hvd.SyncBatchNorm(3).to(dev)(torch.randn(4, 3, 2, 2, device=dev) + r)
    assert y.device == dev
    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
    model(torch.randn(5, 3, device=dev) * (r + 1)).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, 0)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    same = hvd.allgather(flat[None])
    got = hvd.broadcast_object({"t": torch.ones(2, device=dev)}, 0)["t"]
    hvd.shutdown()
    return {"replicas_equal": bool((same == same[0]).all()), "object_device": got.device.type}


@pytest.mark.parametrize("n,backend", [(2, "gloo"), (1, None)])
def test_cuda_tensors(n: int, backend: str | None) -> None:
    for got in run_ranks(n, body, backend, timeout=180):
        assert got == {"replicas_equal": True, "object_device": "cuda"}
