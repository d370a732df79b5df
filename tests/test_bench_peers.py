"""``bench train``'s peers and ceilings (``scaleout.bench.train_peers``,
``scaleout.bench.train_ceilings``): DDP's bucket layouts as they ran, the best tuned DDP,
PowerSGD's warm-up, the lockstep ceilings, the optimizer every configuration shares."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from scaleout.bench.train import TrainBenchConfig
from scaleout.bench.train_report import best_tuned
from scaleout.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["bench", "train", "--workload", "digits-mlp", "--ranks", "2", "--rounds", "1",
        "--iters", "3", "--warmup", "1", "--no-progress"]


@pytest.fixture
def rank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Ranks find this checkout's package."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", SRC if not path else f"{SRC}{os.pathsep}{path}")
    return tmp_path


def body_lockstep(traffic: bool) -> list[float]:
    import torch
    import torch.distributed as tdist

    from scaleout.bench.train_ceilings import build_lockstep

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    opt = build_lockstep(model.parameters(), traffic=traffic, timeout_s=30, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    rank = tdist.get_rank()
    for step in range(3):
        x = torch.full((4, 3), float(rank + step))
        for net, optimizer in ((model, opt), (reference, plain)):
            net(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    opt.finish()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), "lockstep must update exactly like SGD, locally"
    if traffic:  # the traffic really went over the wire: zeros summed stay zeros, size matches
        assert opt._bytes.numel() == sum(p.numel() for p in model.parameters())
        assert opt._inflight is None
    tdist.destroy_process_group()
    return [float(p.sum()) for p in model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("traffic", [False, True])
def test_lockstep_trains_each_copy_alone(traffic: bool) -> None:
    from harness import run_ranks

    first, second = run_ranks(2, body_lockstep, traffic, timeout=45)
    assert first != second  # no gradient exchange: the copies drift apart, as documented


@pytest.mark.timeout(240)
def test_tuned_ddp_peers_and_ceilings_are_configurations(
        rank_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ddp-tuned (bucket view, static graph) at torch's default buckets and a swept bucket
    size, and the two ceilings, in one run; scaleout against the fastest of ddp and the
    tuned ones."""
    out = rank_env / "out.json"
    peers = "ddp,ddp-tuned,ddp-tuned:5,lockstep,lockstep-traffic"
    assert main([*TINY, "--vs", peers, "--no-testbed", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"single", "scaleout", *peers.split(",")}
    for name in peers.split(","):
        assert summary[name]["efficiency"] > 0
        assert summary["scaleout"]["over_peers"][name] > 0
    tuned = summary["ddp-tuned"]["details"]
    assert tuned["bucket_cap_mb"] is None and tuned["static_graph"] is True
    assert summary["ddp-tuned:5"]["details"]["bucket_cap_mb"] == 5
    assert tuned["buckets_mib"] == summary["ddp"]["details"]["buckets_mib"] == [0.07]
    best = min(("ddp", "ddp-tuned", "ddp-tuned:5"), key=lambda n: summary[n]["iter_ms"])
    assert summary["scaleout"]["over_best_tuned"]["peer"] == best
    assert summary["scaleout"]["over_best_tuned"]["ratio"] == summary["scaleout"]["over_peers"][best]
    text = capsys.readouterr().out
    assert "ddp-tuned:5" in text and "vs ddp-tuned" in text and "vs lockstep-traffic" in text
    assert f"vs best tuned: against {best}, the fastest of ddp and the ddp-tuned" in text


class _Layers:
    """A workload of six 4 MiB layers (torch's first bucket, 1 MiB, closes after one)."""

    name = "six-layers"

    def build_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(6)))


def body_buckets(name: str) -> list[float]:
    from scaleout.bench.train_peers import SetupOptions, build_setup

    options = SetupOptions(workload=_Layers(), timeout_s=60)  # type: ignore[arg-type]
    setup = build_setup(name, options)
    for _ in range(4):  # (static_graph rebuilds the buckets after its second)
        setup.model(torch.ones(2, 1024)).sum().backward()
    setup.after_round()
    assert setup.details["buckets_rebuilt"] is True
    # (no setup.close(): destroying DDP's group as the ranks leave at different moments hung
    # a rank now and then, in C++; the harness ends each rank with os._exit)
    return setup.details["buckets_mib"]


@pytest.mark.timeout(120)
def test_bare_ddp_tuned_has_torchs_default_buckets() -> None:
    """Naming bucket_cap_mb=25 also makes DDP's first bucket 25 MiB (torch 2.13); bare
    ddp-tuned passes None and gets ddp's layout, and the JSON has the buckets DDP reduced."""
    from harness import run_ranks

    buckets = {name: run_ranks(2, body_buckets, name, timeout=60)[0]
               for name in ("ddp", "ddp-tuned", "ddp-tuned:25")}
    assert buckets["ddp"] == buckets["ddp-tuned"] == [4.0, 20.02]
    assert buckets["ddp-tuned:25"] == [24.02]


def test_best_tuned_is_the_fastest_of_ddp_and_the_tuned_peers() -> None:
    summary = {"ddp": {"iter_ms": 10.0}, "ddp-tuned": {"iter_ms": 11.0},
               "ddp-tuned:10": {"iter_ms": 9.0}, "zero": {"iter_ms": 1.0},
               "ddp-tuned:50": {"iter_ms": None}}
    assert best_tuned(summary, list(summary)) == "ddp-tuned:10"
    assert best_tuned(summary, ["ddp", "zero"]) is None  # no tuned peer: no column


def test_ddp_powersgd_needs_its_compressed_iterations_in_the_warm_up(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Iterations 0 and 1 of torch's PowerSGD hook are plain allreduce: with --warmup 1 they
    were timed. The configuration refuses it; the command raises the warm-up and says so."""
    with pytest.raises(ValueError, match="ddp-powersgd compresses from iteration 2"):
        TrainBenchConfig(workload="digits-mlp", peers=("ddp-powersgd",), warmup=1,
                         testbed=False)
    TrainBenchConfig(workload="digits-mlp", peers=("ddp-powersgd",), warmup=2, testbed=False)
    from scaleout.bench import train

    seen = {}

    def run_benchmark(config: TrainBenchConfig, progress: bool = True) -> dict:
        seen["warmup"] = config.warmup
        raise KeyboardInterrupt  # (stop before any rank starts)

    monkeypatch.setattr(train, "run_benchmark", run_benchmark)
    assert main([*TINY, "--vs", "ddp,ddp-powersgd", "--no-testbed"]) == 128 + 2
    assert seen == {"warmup": 2}
    assert "--warmup 1 raised to 2: ddp-powersgd compresses from iteration 2" in \
        capsys.readouterr().err


def test_every_configuration_trains_tables_with_plain_sgd() -> None:
    """DLRM's tables get no momentum (what hybrid's sparse row update computes), the dense
    layers momentum 0.9; a model without tables has one group; every parameter once."""
    from scaleout.bench.train_peers import param_groups
    from scaleout.workloads import get_workload

    net = get_workload("dlrm").build_model(0)
    dense, tables = param_groups(net)
    assert "momentum" not in dense and tables["momentum"] == 0.0
    assert {id(p) for p in tables["params"]} == {id(p) for p in net.embeddings.parameters()}
    assert len(dense["params"]) + len(tables["params"]) == len(list(net.parameters()))
    (only,) = param_groups(get_workload("digits-mlp").build_model(0))
    assert len(only["params"]) == len(list(get_workload("digits-mlp").build_model(0).parameters()))
