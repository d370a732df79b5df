"""``scaleout bench train --trace DIR``: per-rank traces of every scaleout run, fed to the simulator.

One tiny run over loopback (digits-mlp, 2 ranks, one round of 3 iterations): the scaleout
configuration's two ranks leave ``trace.<rank>.json`` under ``DIR/scaleout/round0``; the
configurations that do not train with ``DataParallel`` (single, ddp) leave nothing; the files
are read back by the simulator (``sim run --trace``) and merged by ``sim chrome``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scaleout.bench.train import TrainBenchConfig, trace_folder
from scaleout.bench.train_setup import LEAD_IN
from scaleout.cli.main import main
from scaleout.sim.trace import read_trace

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.timeout(240)
def test_bench_train_records_every_scaleout_runs_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", SRC if not path else f"{SRC}{os.pathsep}{path}")
    monkeypatch.delenv("SCALEOUT_TRACE", raising=False)
    traces, out = tmp_path / "traces", tmp_path / "out.json"
    argv = ["bench", "train", "--workload", "digits-mlp", "--ranks", "2", "--rounds", "1",
            "--iters", "3", "--warmup", "1", "--vs", "ddp", "--no-progress", "--no-testbed",
            "--trace", str(traces), "--json", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in traces.iterdir()) == ["scaleout"]  # single, ddp: no DataParallel
    folder = traces / "scaleout" / "round0"
    assert sorted(p.name for p in folder.iterdir()) == ["trace.0.json", "trace.1.json"]
    for rank in (0, 1):
        data = json.loads((folder / f"trace.{rank}.json").read_text())
        assert data["rank"] == rank and data["workload"] == "digits-mlp"
        assert data["batch_size"] == 32 and data["iterations"] == 1 + LEAD_IN + 3  # warmup,
        # the lead-in and the timed ones
        assert {e["lane"] for e in data["events"]} >= {"compute", "comm"}
        assert sum(layer["grad_bytes"] for layer in data["layers"]) > 0
        workload = read_trace(folder / f"trace.{rank}.json")  # the simulator's reader
        assert workload.compute_s > 0
    runs = {r["config"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["scaleout"]["trace_dir"] == str(folder)
    assert "trace_dir" not in runs["single"] and "trace_dir" not in runs["ddp"]
    capsys.readouterr()
    assert main(["sim", "chrome", str(folder)]) == 0
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
