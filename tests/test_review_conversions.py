"""Review of stop 52: a refused conversion names its parameter even when the user replaced
it in the bare module since (the lookup raised a bare StopIteration, not the refusal)."""

from __future__ import annotations

import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel


def body_replaced_then_converted() -> str:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model = DataParallel(net, env.create_distribution())
    model(torch.randn(2, 4)).sum().backward()  # the buckets exist
    model.synchronize()
    net[0].weight = nn.Parameter(net[0].weight.detach().clone())  # replaced by hand
    try:
        model.double()
        outcome = "converted"
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        outcome = f"{type(err).__name__}: {err}"
    model.close()
    env.finalize()
    return outcome


def test_a_refused_conversion_of_a_replaced_parameter_is_a_runtime_error() -> None:
    for outcome in run_ranks(2, body_replaced_then_converted, timeout=60):
        assert outcome.startswith("RuntimeError: DataParallel: this conversion"), outcome
        assert "no longer in model.module" in outcome, outcome
