"""``scaleout bench train --parallel hybrid``: the sharded-table DLRM runs beside DDP, reports
its parameter bytes per rank, and plans its tables under ``--memory-budget``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from scaleout.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
BASE = ["bench", "train", "--workload", "dlrm", "--ranks", "2", "--rounds", "1", "--iters", "2",
        "--warmup", "1", "--batch", "32", "--vs", "ddp", "--no-progress", "--no-testbed"]


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", SRC if not path else f"{SRC}{os.pathsep}{path}")


@pytest.mark.timeout(240)
def test_hybrid_beside_ddp_under_a_budget(rank_env: None, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    assert main([*BASE, "--parallel", "hybrid", "--memory-budget", "4m",
                 "--vs", "ddp,hybrid-deferred,hybrid-noprefetch,hybrid-unfused,lockstep,"
                 "hybrid-lockstep,hybrid-one-round,hybrid-two-rounds", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    # every hybrid variant holds DDP's model (its tables gathered whole), up to float order
    assert report["checks"]["wrong"] == []
    for name in ("hybrid", "hybrid-deferred", "hybrid-noprefetch", "hybrid-unfused",
                 "hybrid-one-round", "hybrid-two-rounds"):
        assert summary[name]["check"]["exact"] and summary[name]["check"]["reference"] == "ddp"
        assert summary[name]["check"]["distance"] < report["checks"]["exact_tolerance"], name
    assert "check" not in summary["hybrid-lockstep"]  # not a trainer
    assert set(summary) == {"single", "scaleout", "ddp", "hybrid", "hybrid-deferred",
                            "hybrid-noprefetch", "hybrid-unfused", "lockstep", "hybrid-lockstep",
                            "hybrid-one-round", "hybrid-two-rounds"}
    # prefetching the next batch's ids and rows, and deferring the rows' gradients, train
    # the same model, to the last bit
    assert summary["hybrid"]["final_loss"] == summary["hybrid-noprefetch"]["final_loss"]
    assert summary["hybrid"]["final_loss"] == summary["hybrid-deferred"]["final_loss"]
    # the ids with the rows' gradients, alone in one round (the bench knows the batch) or in
    # two: the same ids, the same model
    assert summary["hybrid"]["final_loss"] == summary["hybrid-one-round"]["final_loss"]
    assert summary["hybrid"]["final_loss"] == summary["hybrid-two-rounds"]["final_loss"]
    assert summary["hybrid"]["details"]["ids"] == ("counts and ids with the rows' gradients of "
                                                   "the backward before")
    assert summary["hybrid-one-round"]["details"]["ids"] == "counts and ids in one round"
    assert summary["hybrid-two-rounds"]["details"]["ids"] == "counts, then ids"
    assert "land before the tables' step" in summary["hybrid-deferred"]["details"]["backward"]
    assert summary["hybrid"]["details"]["backward"].startswith("blocks")
    assert summary["hybrid"]["final_loss"] == pytest.approx(summary["ddp"]["final_loss"], 1e-5)
    # the tables' SGD in backward is the step on their sparse gradients (up to float order)
    assert summary["hybrid"]["details"]["table_optimizer"] == "SGD (rows) in backward"
    assert summary["hybrid-unfused"]["details"]["table_optimizer"] == "SGD (sparse rows)"
    assert summary["hybrid"]["final_loss"] == pytest.approx(
        summary["hybrid-unfused"]["final_loss"], 1e-6)
    assert "lookups once the tables are updated" in summary["hybrid"]["details"]["prefetch"]
    assert summary["hybrid"]["details"]["prefetch"].endswith("at the end of backward)")
    assert summary["hybrid-unfused"]["details"]["prefetch"].endswith("after their step)")
    assert summary["hybrid-noprefetch"]["details"]["prefetch"] is None
    hybrid, ddp = summary["hybrid"]["details"], summary["ddp"]["details"]
    assert hybrid["param_bytes"] < 0.6 * ddp["param_bytes"]
    assert hybrid["fits_memory_budget"] and not ddp["fits_memory_budget"]
    assert "rank 1: 13 tables" in hybrid["tables"]
    assert summary["hybrid"]["bytes_per_iter"] > 0  # its Statistics: gradients + activations
    assert "hybrid" in capsys.readouterr().out
    # the ceiling: every rank alone with all the tables, hybrid's lookups and update, trains
    # its own copy as lockstep does (the same optimizer; up to float order)
    ceiling = summary["hybrid-lockstep"]["details"]
    assert "rank 0: 26 tables" in ceiling["tables"] and not ceiling["fits_memory_budget"]
    assert ceiling["exchange"] == "one 4-byte allreduce per iteration"
    assert summary["hybrid-lockstep"]["final_loss"] == pytest.approx(
        summary["lockstep"]["final_loss"], 1e-6)
    assert summary["hybrid-lockstep"]["final_loss"] != pytest.approx(
        summary["hybrid"]["final_loss"], 1e-6)  # each rank its own copy: not the trained model


@pytest.mark.parametrize(("extra", "message"), [
    (["--memory-budget", "lots"], "--memory-budget: size must look like '64MB'"),
    (["--memory-budget", "0"], "memory_budget: expected bytes >= 1, got 0"),
])
def test_budget_errors(extra: list[str], message: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--parallel", "hybrid", *extra]) == 2
    assert message in capsys.readouterr().err
