"""torch.compile inside and outside DataParallel trains like eager mode, and scaleout's hooks
cause no warning (dynamo never traces them: they are opaque to it)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import machine_notice, run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def train(where: str, env: scaleout.Environment) -> list[float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if where == "inside":
        model = DataParallel(torch.compile(net), env.create_distribution())
        wrapper = model
    elif where == "outside":
        wrapper = DataParallel(net, env.create_distribution())
        model = torch.compile(wrapper)
    else:
        model = wrapper = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), wrapper)
    g = torch.Generator().manual_seed(env.rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    wrapper.synchronize()
    wrapper.close()
    return losses


def body() -> tuple[dict[str, list[float]], list[str]]:
    env = scaleout.init(timeout=300)
    handler = _Collect()
    logging.getLogger("torch").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = {where: train(where, env) for where in ("eager", "inside", "outside")}
    env.finalize()
    # torch's own deprecation notices (torch.jit internals on import) are not ours to fix
    noise = [str(w.message).splitlines()[0] for w in caught
             if not issubclass(w.category, DeprecationWarning)] + handler.records
    noise = [line for line in noise if not machine_notice(line)]
    return losses, noise


@pytest.mark.timeout(420)  # compiling takes ~10 s alone, minutes on a loaded 2-core machine
def test_torch_compile_inside_and_outside_trains_like_eager_without_warnings() -> None:
    for losses, noise in run_ranks(2, body, timeout=400, start_method="spawn"):
        assert not noise, noise
        for where in ("inside", "outside"):
            torch.testing.assert_close(torch.tensor(losses[where]), torch.tensor(losses["eager"]),
                                       rtol=1e-5, atol=1e-6)
