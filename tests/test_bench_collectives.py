"""`scaleout bench collectives` through the real command: ranks launched, both sides timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleout.bench.collectives import bus_factor
from scaleout.cli.main import main


@pytest.mark.timeout(120)
def test_smoke_writes_paired_rounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "coll.json"
    assert main(["bench", "collectives", "-n", "2", "--ops", "allreduce,alltoall", "--sizes",
                 "4K,64K", "--rounds", "3", "--budget", "0.01", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    rows = report["results"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("allreduce", 4096), ("allreduce", 65536), ("alltoall", 4096), ("alltoall", 65536)]
    for row in rows:
        assert len(row["times_s"]) == len(row["torch_times_s"]) == 3
        assert all(t > 0 for t in row["times_s"] + row["torch_times_s"])
        assert row["ratio"] > 0
        assert row["busbw_GBps"] == pytest.approx(
            row["algbw_GBps"] * bus_factor(row["op"], 2), rel=1e-9)
    assert "ours/torch" in capsys.readouterr().out
    # what reproducing it takes: the command, when, the machine, the code, the environment
    assert report["command"][:3] == ["scaleout", "bench", "collectives"] and report["date"]
    assert report["machine"]["cpus"] >= 1 and report["machine"]["torch"]
    assert "git" in report["source"] and isinstance(report["scaleout_env"], dict)


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("allreduce", 4) == 1.5
    assert bus_factor("allgather", 4) == 0.75
    assert bus_factor("bcast", 4) == 1.0


@pytest.mark.parametrize("extra,message", [
    (["--budget", "nan"], "--budget must be > 0 seconds"),  # was a traceback on every rank
    (["--budget=-1"], "--budget must be > 0 seconds"),  # was accepted
    (["--json", "/no/such/folder/out.json"], "--json /no/such/folder/out.json: no folder"),
])
def test_arguments_are_refused_before_any_rank_starts(extra: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "collectives", "-n", "2", "--sizes", "1K", *extra]) == 2
    assert message in capsys.readouterr().err
