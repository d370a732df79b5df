"""``scaleout bench train --trace DIR``: per-rank traces of every scaleout run, fed to the simulator.

One tiny run over loopback (digits-mlp, 2 ranks, two rounds of fresh ranks of 3 iterations:
conftest.py's cold_bench, also test_bench_train.py's cold smoke run): the scaleout
configuration's two ranks leave ``trace.<rank>.json`` under ``DIR/scaleout/round<r>`` every
round; the configurations that do not train with ``DataParallel`` (single, ddp) leave nothing;
the files are read back by the simulator (``sim run --trace``) and merged by ``sim chrome``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleout.bench.train import TrainBenchConfig, trace_folder
from scaleout.bench.train_setup import LEAD_IN
from scaleout.cli.main import main
from scaleout.sim.trace import read_trace


@pytest.mark.timeout(240)
def test_bench_train_records_every_scaleout_runs_traces(
    cold_bench: tuple[int, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, folder = cold_bench
    assert code == 0
    traces = folder / "traces"
    assert sorted(p.name for p in traces.iterdir()) == ["scaleout"]  # single, ddp: no DataParallel
    assert sorted(p.name for p in (traces / "scaleout").iterdir()) == ["round0", "round1"]
    for round_dir in (traces / "scaleout").iterdir():
        assert sorted(p.name for p in round_dir.iterdir()) == ["trace.0.json", "trace.1.json"]
        for rank in (0, 1):
            data = json.loads((round_dir / f"trace.{rank}.json").read_text())
            assert data["rank"] == rank and data["workload"] == "digits-mlp"
            assert data["batch_size"] == 32 and data["iterations"] == 1 + LEAD_IN + 3  # warmup,
            # the lead-in and the timed ones (fresh ranks every round)
            assert {e["lane"] for e in data["events"]} >= {"compute", "comm"}
            assert sum(layer["grad_bytes"] for layer in data["layers"]) > 0
            workload = read_trace(round_dir / f"trace.{rank}.json")  # the simulator's reader
            assert workload.compute_s > 0
    runs = json.loads((folder / "out.json").read_text())["runs"]
    for run in runs:
        if run["config"] == "scaleout":
            assert run["trace_dir"] == str(traces / "scaleout" / f"round{run['round']}")
        else:
            assert "trace_dir" not in run, run["config"]
    capsys.readouterr()
    assert main(["sim", "chrome", str(traces / "scaleout" / "round0")]) == 0
    assert "2 ranks" in capsys.readouterr().out


def test_trace_folder_and_validation(tmp_path: Path) -> None:
    config = TrainBenchConfig(workload="digits-mlp", testbed=False, trace=str(tmp_path))
    assert trace_folder(config, "scaleout+blockquant", 2) == str(
        tmp_path / "scaleout+blockquant" / "round2")
    assert trace_folder(TrainBenchConfig(workload="digits-mlp", testbed=False), "scaleout", 0) is None
    with pytest.raises(ValueError, match="trace: expected a folder name"):
        TrainBenchConfig(workload="digits-mlp", testbed=False, trace="")


def test_each_round_sets_its_own_trace_folder(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from scaleout.bench import train

    seen: dict[str, str] = {}

    def fake_launch(target, config, wrapper=None, out=None):  # noqa: ANN001
        seen.update(config.env)
        return 3

    monkeypatch.setattr(train, "launch", fake_launch)
    cfg = TrainBenchConfig(workload="digits-mlp", testbed=False, trace=str(tmp_path))
    place = train.Placement(wrapper=None, master_addr="127.0.0.1", network={})
    with pytest.raises(train.BenchFailed):
        train._run_once(cfg, "scaleout", place, str(tmp_path), None, round_index=2)
    assert seen["SCALEOUT_TRACE"] == str(tmp_path / "scaleout" / "round2")
    seen.clear()
    untraced = TrainBenchConfig(workload="digits-mlp", testbed=False)
    with pytest.raises(train.BenchFailed):
        train._run_once(untraced, "scaleout", place, str(tmp_path), None)
    assert "SCALEOUT_TRACE" not in seen
