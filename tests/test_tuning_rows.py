"""The tuner prices an embedding table that travels row-sparse at the bytes it moves."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.pytorch.tuning import TuneConfig, _moved, _workload
from scaleout.sim.tuning import LinkModel

SLOW = LinkModel(ranks=2, latency_s=1e-3, seconds_per_byte=1e-6)  # ~1 MB/s

ROWS, DIM, TOUCHED = 4096, 16, 64  # each batch looks up 64 of the table's 4096 rows


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


def body(rows: str) -> dict:
    os.environ["SCALEOUT_LOOKUP_ROWS"] = rows  # (over loopback the default is dense)
    env = scaleout.init(timeout=60)
    net = _Net()
    model = DataParallel(net, env.create_distribution(),
                         tune=TuneConfig(allow_lossy=True, link=SLOW, verify=0))
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), model)
    generator = torch.Generator().manual_seed(1 + env.rank)
    for _ in range(6):
        ids = torch.randint(0, TOUCHED, (32,), generator=generator)
        y = torch.randint(0, 10, (32,), generator=generator)
        F.cross_entropy(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    out = {"summary": model.tuning.summary(), "key": repr(model.tuning.key()),
           "codecs": dict(model.tuning.codecs)}
    model.close()
    env.finalize()
    return out


def test_a_row_sparse_table_is_priced_at_its_rows_and_keeps_them() -> None:
    sparse, dense = run_ranks(2, body, "1", timeout=120), run_ranks(2, body, "0", timeout=120)
    assert sparse[0]["key"] == sparse[1]["key"] and dense[0]["key"] == dense[1]["key"]
    # measured during the tuner's window: under 64 of 4096 rows plus a flag per row, ~2.8%
    found = re.search(r"row-sparse: 1 layer\(s\) .*\(table ([0-9.]+)%\)", sparse[0]["summary"])
    assert found and 1.0 < float(found.group(1)) < 6.0, sparse[0]["summary"]
    # priced dense, the 256 KB table at ~1 MB/s wants a codec; priced at the rows it sends,
    # no codec shrinks it by the 10% a lossy one must gain, and it keeps its exact rows
    assert "table" in dense[0]["codecs"], dense[0]["summary"]
    assert "table" not in sparse[0]["codecs"], sparse[0]["summary"]
    assert "row-sparse" not in dense[0]["summary"]


def test_the_share_moved_and_the_bytes_priced() -> None:
    # snapshots: (compute, backward, sent bytes, raw bytes)
    assert _moved((1.0, 0.5, 300.0, 1000.0), (0.0, 0.0, 100.0, 0.0)) == pytest.approx(0.2)
    assert _moved((1.0, 0.5, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0)) == 1.0  # nothing recorded

    class _Layer:
        def __init__(self, name: str, numel: int) -> None:
            self.name, self.params = name, [torch.zeros(numel)]

    layers = [_Layer("a", 1000), _Layer("b", 10)]
    workload = _workload(layers, [3.0, 1.0, 1.0, 0.5], 1, [0.25, 1.0])
    assert [layer.grad_bytes for layer in workload.layers] == [1000, 40]
    assert [layer.grad_bytes for layer in _workload(layers, [3.0, 1.0, 1.0, 0.5], 1).layers] \
        == [4000, 40]
