"""``bench train`` checks that every configuration trained what it should
(``scaleout.bench.train_checks``, ``scaleout.bench.train_digest``): the verdicts on digests
made up here, and a real run in which scaleout is made wrong on purpose.

The fault lives in a ``sitecustomize`` module written by the test and put on the ranks'
``PYTHONPATH``: production code has no hook for it. (The audit's sabotaged scaleout, which
never averaged its gradients, reported 4.757x ddp with exit code 0.)
"""

from __future__ import annotations

import doctest
import json
import math
import os
import textwrap
from pathlib import Path

import pytest

from scaleout.bench import train_checks, train_digest
from scaleout.bench.train_checks import (EXACT_TOLERANCE, REPLICA_TOLERANCE, check_round,
                                         check_rounds, distance, is_exact, suspects)
from scaleout.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")

#: Rank processes that load this never average their gradients in scaleout's DataParallel
#: (every forward runs as in ``no_sync()``), when BENCH_TEST_FAULT=no-average.
FAULT = textwrap.dedent('''
    import importlib.abc, importlib.machinery, os, sys

    class _Fault(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "scaleout.pytorch.data_parallel":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                forward = module.DataParallel.forward

                def no_average(self, *args, **kwargs):
                    self._no_sync = True  # each rank steps on its own gradient
                    return forward(self, *args, **kwargs)

                module.DataParallel.forward = no_average

            spec.loader.exec_module = exec_module
            return spec

    if os.environ.get("BENCH_TEST_FAULT") == "no-average":
        sys.meta_path.insert(0, _Fault())
''')


def _digest(moved: float, projections: tuple[float, ...] = (0.5, -0.5),
            start: float = 10.0) -> list[float]:
    """A digest of a 100-value parameter that moved by ``moved`` (norm) from ``start``."""
    return [100, start, start * start, 0.0, moved * moved, *projections]


def _run(name: str, digests: list[dict], steps: int = 8) -> dict:
    return {"config": name, "round": 0, "digests": digests, "steps": steps}


def test_distance_reads_the_movement() -> None:
    a = {"w": _digest(1.0, (0.5, -0.5)), "b": _digest(0.0, (0.0, 0.0))}
    assert distance(a, a) == (0.0, None)
    apart = {"w": _digest(1.0, (0.6, -0.4)), "b": a["b"]}
    gap, where = distance(a, apart)
    assert gap == pytest.approx(0.1) and where == "w"  # 0.1 apart over a movement of 1
    assert distance(a, {"w": a["w"]})[0] == math.inf  # a parameter missing
    assert distance(a, {**a, "w": [99, *a["w"][1:]]})[0] == math.inf  # another shape
    started_apart = {**a, "b": _digest(0.0, (0.0, 0.0), start=11.0)}
    assert distance(a, started_apart)[0] > 0.5  # b did not move, yet its sums differ


def test_which_configurations_are_exact() -> None:
    for name in ("scaleout", "scaleout+auto-exact", "scaleout-sharded", "ddp", "ddp-tuned",
                 "ddp-tuned:5", "zero", "hybrid", "hybrid-unfused"):
        assert is_exact(name), name
    for name in ("scaleout+cast:bf16", "scaleout+auto", "ddp-fp16", "ddp-powersgd", "single",
                 "lockstep", "lockstep-traffic", "hybrid-lockstep"):
        assert not is_exact(name), name


def test_verdicts_of_a_round() -> None:
    good = {"w": _digest(1.0)}
    off = {"w": _digest(1.0, (0.9, -0.1))}
    close = {"w": _digest(1.0, (0.5 + EXACT_TOLERANCE / 2, -0.5))}
    runs = {"ddp": _run("ddp", [good, good]), "scaleout": _run("scaleout", [good, off]),
            "zero": _run("zero", [off, off]), "scaleout-sharded": _run("scaleout-sharded",
                                                                       [close, close]),
            "scaleout+sign": _run("scaleout+sign", [off, off]),
            "lockstep": _run("lockstep", [good, off]),
            "ddp-tuned": _run("ddp-tuned", [good, good], steps=9)}
    verdicts = check_round(runs)
    assert "lockstep" not in verdicts  # not a trainer: its copies drift apart by design
    assert verdicts["ddp"]["wrong"] == [] and verdicts["ddp"]["distance"] is None
    assert verdicts["scaleout-sharded"]["wrong"] == []
    (replicas,) = verdicts["scaleout"]["wrong"]
    assert replicas.startswith("its ranks' parameters differ") and "most in w" in replicas
    assert verdicts["scaleout"]["replicas"] > REPLICA_TOLERANCE
    (apart,) = verdicts["zero"]["wrong"]
    assert apart.startswith("its parameters differ from ddp's: distance 0.4 of the movement")
    lossy = verdicts["scaleout+sign"]  # reported, not judged
    assert lossy["wrong"] == [] and lossy["distance"] == pytest.approx(0.4)
    assert verdicts["ddp-tuned"]["wrong"] == ["it took 9 steps, ddp 8"]
    # without ddp: ddp-tuned, then zero, then the first exact one whose ranks agree
    del runs["ddp"]
    assert check_round(runs)["zero"]["reference"] == "ddp-tuned"
    del runs["ddp-tuned"], runs["zero"]
    assert check_round(runs)["scaleout"]["reference"] == "scaleout-sharded"


def test_every_round_is_checked_and_marked() -> None:
    good, off = {"w": _digest(1.0)}, {"w": _digest(1.0, (0.9, -0.1))}
    runs = [{**_run("ddp", [good, good]), "round": r} for r in (0, 1)]
    runs += [{**_run("scaleout", [good, good] if r == 0 else [good, off]), "round": r}
             for r in (0, 1)]
    runs.append({"config": "zero", "round": 0, "error": "crashed"})
    summary = check_rounds(runs)
    assert set(summary) == {"ddp", "scaleout"}
    assert [why.split(":")[0] for why in summary["scaleout"]["wrong"]] == ["round 1"]
    assert runs[2]["check"]["wrong"] == [] and runs[3]["check"]["wrong"]


def test_faster_than_the_ceiling_is_suspect() -> None:
    summary = {"lockstep": {"throughput_per_round": [100.0, 104.0]},
               "hybrid-lockstep": {"throughput_per_round": [300.0]},
               "scaleout": {"throughput_per_round": [110.0, 120.0]},
               "ddp": {"throughput_per_round": [90.0, 105.0]},  # within the spread
               "hybrid": {"throughput_per_round": [200.0]}}  # against its own ceiling
    (line,) = suspects(summary)
    assert line.startswith("scaleout ran faster than its ceiling lockstep in every round")


@pytest.mark.parametrize("module", [train_checks, train_digest])
def test_doctests(module: object) -> None:
    assert doctest.testmod(module).failed == 0  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_a_scaleout_that_never_averages_is_reported_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), SRC, path) if p))
    monkeypatch.setenv("BENCH_TEST_FAULT", "no-average")
    out = tmp_path / "out.json"
    code = main(["bench", "train", "--workload", "digits-mlp", "--ranks", "2", "--rounds", "1",
                 "--iters", "3", "--warmup", "1", "--vs", "ddp", "--no-progress",
                 "--no-testbed", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "WRONG: scaleout: round 0: its ranks' parameters differ" in captured.out
    assert "WRONG: scaleout: round 0: its parameters differ from ddp's" in captured.out
    assert "1 configuration(s) trained wrong: scaleout" in captured.err
    report = json.loads(out.read_text())
    assert [line.split(":")[0] for line in report["checks"]["wrong"]] == ["scaleout"] * 2
    assert report["summary"]["ddp"]["check"]["wrong"] == []
    (run,) = [r for r in report["runs"] if r["config"] == "scaleout"]
    assert run["check"]["replicas"] > 0.1 and run["check"]["distance"] > 0.1
    assert report["scaleout_env"] == {}  # (BENCH_TEST_FAULT is not scaleout's)
