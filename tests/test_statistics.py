"""Statistics of a DataParallel run: per-layer compute, communication time and bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer


def body() -> dict[str, dict[str, float]]:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model = DataParallel(net, env.create_distribution(), compression={"2.weight": "cast:bf16"})
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    for _ in range(3):
        F.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 32, (8,))).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    stats = model.statistics
    result = stats.as_dict()
    assert stats.iterations == 3
    assert "compute ms" in stats.table()
    model.close()
    env.finalize()
    return result


def test_layers_report_compute_communication_and_bytes() -> None:
    stats = run_ranks(2, body, timeout=60)[0]
    for layer, numel in (("0", 32 * 64 + 64), ("2", 64 * 32 + 32)):
        assert stats[layer]["compute_s"] > 0, stats[layer]
        assert stats[layer]["comm_s"] > 0, stats[layer]
        assert stats[layer]["raw_bytes"] == 3 * 4 * numel  # fp32, three iterations
        assert stats[layer]["iterations"] == 3, stats[layer]  # (it read 0)
    # layer 2's weight travels as bf16: fewer bytes than raw; layer 0 goes exact
    assert stats["2"]["bytes"] < stats["2"]["raw_bytes"]
    assert stats["0"]["bytes"] == stats["0"]["raw_bytes"]


def body_trace(folder: str) -> None:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model = DataParallel(net, env.create_distribution(), trace=folder)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    for _ in range(3):
        F.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 32, (8,))).backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    model.close()  # writes trace.<rank>.json
    env.finalize()


def test_a_run_records_a_trace_that_the_simulator_and_chrome_read(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from scaleout.sim.trace import read_trace

    run_ranks(2, body_trace, str(tmp_path), timeout=60)
    for rank in range(2):
        data = json.loads((tmp_path / f"trace.{rank}.json").read_text())
        assert data["rank"] == rank and data["batch_size"] == 8 and data["iterations"] == 3
        lanes = {(e["lane"], e.get("phase")) for e in data["events"]}
        assert {("compute", "forward"), ("compute", "backward"), ("compute", "update"),
                ("comm", None)} <= lanes, lanes
        comm = [e for e in data["events"] if e["lane"] == "comm"]
        assert all(e["end"] >= e["start"] and e["bytes"] > 0 and "priority_lane" in e for e in comm)
        assert [layer["name"] for layer in data["layers"]] == ["0", "2"]
        assert data["layers"][0]["grad_bytes"] == 4 * (32 * 64 + 64)
    workload = read_trace(tmp_path / "trace.0.json")  # the simulator's reader
    assert [layer.name for layer in workload.layers] == ["0", "2"]
    out = tmp_path / "chrome.json"
    done = subprocess.run([sys.executable, "-m", "scaleout", "sim", "chrome", str(tmp_path),
                           "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}  # a track per rank
