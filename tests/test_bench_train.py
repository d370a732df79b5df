"""Tests of ``scaleout bench train`` (``scaleout.bench.train*``, ``scaleout.cli.bench_train``).

The smoke runs launch real ranks of a tiny workload; the one on a testbed is marked
``testbed`` and skips without root/ip/tc, except under ``CI=true`` where it fails.
"""

from __future__ import annotations

import doctest
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scaleout.bench import train, train_progress, train_report
from scaleout.bench.train import TrainBenchConfig, rotation
from scaleout.bench.train_report import format_report, plot_report, summarize
from scaleout.cli.main import main
from scaleout.testbed import TestbedUnavailable

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["bench", "train", "--workload", "digits-mlp", "--ranks", "2", "--rounds", "1",
        "--iters", "3", "--warmup", "1", "--vs", "ddp", "--no-progress"]


from harness import require_testbed as _require_testbed  # noqa: E402


@pytest.fixture
def rank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Ranks find this checkout's package; testbeds keep state in a private directory."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", SRC if not path else f"{SRC}{os.pathsep}{path}")
    monkeypatch.setenv("SCALEOUT_TESTBED_DIR", str(tmp_path / "testbeds"))
    return tmp_path


def _check_report(report: dict, *, testbed: bool, rounds: int = 1) -> None:
    assert report["network"]["testbed"] is testbed
    assert set(report["summary"]) == {"single", "scaleout", "ddp"}
    for name, entry in report["summary"].items():
        assert entry["throughput"] > 0, name
        assert entry["throughput_min"] <= entry["throughput"] <= entry["throughput_max"]
        assert entry["iter_ms"] > 0
        assert ("efficiency" in entry) and ("over_peers" in entry)
    assert report["summary"]["single"]["efficiency"] is None
    assert report["summary"]["scaleout"]["efficiency"] > 0
    assert report["summary"]["ddp"]["efficiency"] > 0
    assert report["summary"]["scaleout"]["over_peers"]["ddp"] > 0
    so = report["summary"]["scaleout"]
    assert so["bytes_per_iter"] > 0 and so["comm_ms_per_iter"] >= 0 and so["exposed_ms_per_iter"] >= 0
    # the policy the open one resolved to: over loopback fifo, always
    assert so["details"]["policy"] == "default"
    assert so["details"]["policy_in_use"] == "fifo" if not testbed else \
        so["details"]["policy_in_use"] in ("fifo", "priority")
    # the same data, seeds and optimizer: exact scaleout and DDP train the same model
    assert so["final_loss"] == pytest.approx(report["summary"]["ddp"]["final_loss"], rel=1e-5)
    assert len(report["runs"]) == 3 * rounds
    assert all(len(r["iter_s"]) == 3 + r["lead_in"] and r["lead_in"] == 1 for r in report["runs"])
    # every trainer checked, right: the same parameters on both ranks, scaleout's as ddp's
    assert report["checks"]["wrong"] == [] and report["settings"]["lead_in"] == 1
    assert so["check"]["replicas"] == 0.0 and so["check"]["reference"] == "ddp"
    assert so["check"]["distance"] < report["checks"]["exact_tolerance"]
    assert all(r["steps"] == (r["round"] + 1) * 5 or not report["warm_ranks"]
               for r in report["runs"])
    # what reproducing it takes
    assert report["source"]["path"].endswith("scaleout") and "scaleout_env" in report
    assert report["machine"]["cpu_model"] is not None and "gpus" in report["machine"]
    assert report["settings"]["warm"] is report["warm_ranks"]
    assert report["settings"]["rate"] == ("1gbit" if testbed else None)
    assert {r["config"] for r in report["runs"]} == {"single", "scaleout", "ddp"}
    assert report["command"].startswith("scaleout ") and report["date"]
    assert report["machine"]["cpus"] >= 1 and report["machine"]["torch"]
    assert report["settings"]["batch"] == 32 and report["settings"]["peers"] == ["ddp"]


@pytest.mark.testbed
@pytest.mark.timeout(240)
def test_smoke_on_testbed(rank_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _require_testbed()
    out = rank_env / "out.json"
    assert main([*TINY, "--rate", "1gbit", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    _check_report(report, testbed=True)
    assert report["network"]["rate"] == "1gbit"
    text = capsys.readouterr().out
    assert "testbed: 2 hosts" in text and "vs ddp" in text
    assert not list((rank_env / "testbeds").glob("*.json")), "the testbed was not removed"


TWO_ROUNDS = [*TINY[:TINY.index("--rounds")], "--rounds", "2", *TINY[TINY.index("--rounds") + 2:]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cold", [False, True])
def test_smoke_without_testbed_warm_or_cold(rank_env: Path, cold: bool,
                                            capsys: pytest.CaptureFixture[str],
                                            request: pytest.FixtureRequest) -> None:
    """Over loopback. Warm (the default): one process set per configuration runs every
    round, each round measured again; --cold: fresh processes every round (the run of
    conftest.py's cold_bench, which test_sim_bench_trace.py reads the traces of)."""
    if cold:
        code, text, folder = request.getfixturevalue("cold_bench")
        out = folder / "out.json"
    else:
        out = rank_env / "out.json"
        code = main([*TWO_ROUNDS, "--no-testbed", "--json", str(out)])
        text = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())
    _check_report(report, testbed=False, rounds=2)
    assert report["warm_ranks"] is not cold
    assert "NO TESTBED" in text and "scaleout: policy default (ran fifo), mode overlap" in text
    assert ("fresh ranks every round" if cold else "warm ranks") in text
    for name in ("single", "scaleout", "ddp"):
        runs = sorted((r for r in report["runs"] if r["config"] == name), key=lambda r: r["round"])
        assert [r["round"] for r in runs] == [0, 1] and all(len(r["iter_s"]) == 4 for r in runs)
        assert len({r["pid"] for r in runs}) == (2 if cold else 1), name


@pytest.mark.timeout(240)
def test_sharded_update_peer_trains_like_its_peers(rank_env: Path) -> None:
    """scaleout-sharded (distributed_update=True) against zero (DDP + ZeRO): the same steps
    of the same model, so the same loss; exact whatever --compression names."""
    out = rank_env / "out.json"
    assert main([*TINY, "--no-testbed", "--vs", "zero,scaleout-sharded", "--compression",
                 "sign", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sharded, zero = report["summary"]["scaleout-sharded"], report["summary"]["zero"]
    assert sharded["final_loss"] == pytest.approx(zero["final_loss"], rel=1e-5)
    assert sharded["details"]["distributed_update"] is True
    assert sharded["details"]["compression"] is None
    assert set(sharded["over_peers"]) == {"zero"}  # not against itself


@pytest.mark.parametrize(("extra", "message"), [
    (["--workload", "resnet9000"], "unknown workload 'resnet9000'"),
    (["--vs", "ddp,horovod"], "peers: unknown 'horovod'"),
    (["--ranks", "0"], "ranks: expected an integer >= 1, got 0"),
    (["--vs", "ddp-tuned:0"], "peers: unknown 'ddp-tuned:0'"),
    (["--vs", "single"], "peers: unknown 'single'"),
    (["--rounds", "0"], "rounds: expected an integer >= 1, got 0"),
    (["--iters", "0"], "iters: expected an integer >= 1"),
    (["--rate", "1gbps"], "rate"),
    (["--compression", "zip"], "zip"),
    # hybrid failed only after every other configuration had run
    (["--parallel", "hybrid"], "peers: the hybrid configurations (hybrid) shard embedding "
                               "tables, and the workload 'digits-mlp' has none"),
    (["--vs", "ddp,hybrid-lockstep"], "(hybrid-lockstep) shard embedding tables"),
])
def test_argument_errors(extra: list[str], message: str,
                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert "scaleout bench train: error:" in err and message in err


@pytest.mark.parametrize("command", [TINY, ["tune", "--workload", "digits-mlp"]])
def test_a_rate_without_a_testbed_is_refused(command: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # loopback has no rate: --rate abc was ignored and the run went on, exit 0
    for rate in ("abc", "100mbit"):
        assert main([*command, "--no-testbed", "--rate", rate]) == 2
        assert "--rate shapes the testbed's links, and --no-testbed runs over loopback" in \
            capsys.readouterr().err


def test_without_root_names_the_way_out(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    def unavailable() -> None:
        raise TestbedUnavailable("the testbed needs root to create network namespaces")

    monkeypatch.setattr("scaleout.testbed.check_capabilities", unavailable)
    assert main(TINY) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "--no-testbed" in err


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main([*TINY, "--no-testbed", "--plot", "x.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_rotation_puts_every_configuration_first_once() -> None:
    names = ("single", "scaleout", "ddp")
    firsts = [rotation(names, r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(names)
    assert all(sorted(rotation(names, r)) == sorted(names) for r in range(5))


def _raw() -> dict:
    """Two rounds; single 100 samples/s then 50; scaleout and ddp at known fractions."""
    cfg = TrainBenchConfig(workload="digits-mlp", peers=("ddp",), rounds=2, testbed=False)
    runs = []
    for r, (single, so, ddp) in enumerate([(100.0, 150.0, 100.0), (50.0, 90.0, 60.0)]):
        for name, thr, ranks in (("single", single, 1), ("scaleout", so, 2), ("ddp", ddp, 2)):
            stats = {"exposed_ms": 2.0 + r, "comm_ms": 5.0, "bytes": 1e6, "raw_bytes": 1e6,
                     "iterations": 3} if name == "scaleout" else None
            runs.append({"round": r, "config": name, "ranks": ranks, "batch_per_rank": 10,
                         "median_iter_s": 10 * ranks / thr, "scaleout_stats": stats,
                         "details": {}})
    return {"config": cfg.as_dict(), "network": {"testbed": False, "description": "loopback"},
            "runs": runs}


def test_summary_figures_are_per_round_then_median() -> None:
    summary = summarize(_raw())
    assert summary["single"]["throughput"] == pytest.approx(75.0)
    # efficiency per round: 150/200 = 0.75, 90/100 = 0.9 -> median 0.825
    assert summary["scaleout"]["efficiency"] == pytest.approx(0.825)
    assert summary["ddp"]["efficiency"] == pytest.approx((0.5 + 0.6) / 2)
    # ratio per round: 1.5 and 1.5 -> 1.5 (not the ratio of medians, 120/80)
    assert summary["scaleout"]["over_peers"]["ddp"] == pytest.approx(1.5)
    assert summary["scaleout"]["exposed_ms_per_iter"] == pytest.approx(2.5)
    assert summary["ddp"]["throughput_min"] == pytest.approx(60.0)
    assert summary["ddp"]["throughput_max"] == pytest.approx(100.0)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot is an optional extra (pip install matplotlib)")
    raw = _raw()
    report = {"settings": raw["config"], "network": raw["network"], "summary": summarize(raw)}
    plot_report(report, str(tmp_path / "chart.png"))
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert "efficiency" in format_report(report)


@pytest.mark.parametrize("module", [train, train_progress, train_report])
def test_doctests(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.failed == 0


def test_several_scaleout_variants_are_configurations() -> None:
    cfg = TrainBenchConfig(workload="digits-mlp", peers=("ddp", "ddp-fp16"), testbed=False,
                           compression=("none", "cast:bf16", "topk:ratio=0.1"))
    assert cfg.configurations == ("single", "scaleout", "scaleout+cast:bf16",
                                  "scaleout+topk:ratio=0.1", "ddp", "ddp-fp16")
    with pytest.raises(ValueError, match="each codec once"):
        TrainBenchConfig(workload="digits-mlp", testbed=False, compression=("sign", "sign"))
    raw = _raw()
    raw["config"]["compression"] = ["none", "sign"]
    for run in [r for r in raw["runs"] if r["config"] == "scaleout"]:
        raw["runs"].append({**run, "config": "scaleout+sign", "median_iter_s": run["median_iter_s"] / 2})
    summary = summarize(raw)
    assert summary["scaleout+sign"]["over_peers"]["ddp"] == pytest.approx(3.0)


@pytest.mark.timeout(240)
def test_a_failing_configuration_is_reported_and_the_others_go_on(
        rank_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """ddp is forced to fail (its ranks run a script that raises); single and scaleout are
    still measured, in every round, and ddp's row says why."""
    real = train._worker_args
    crash = rank_env / "crash.py"
    crash.write_text("raise RuntimeError('forced failure for the test')\n")

    def worker_args(config: TrainBenchConfig, name: str, path: str) -> list[str]:
        return [str(crash)] if name == "ddp" else real(config, name, path)

    monkeypatch.setattr(train, "_worker_args", worker_args)
    out = rank_env / "out.json"
    assert main([*TWO_ROUNDS, "--no-testbed", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "ddp FAILED: RuntimeError: forced failure for the test" in captured.out
    assert "1 configuration(s) failed: ddp" in captured.err
    report = json.loads(out.read_text())
    failed = [r for r in report["runs"] if "error" in r]
    assert [(r["config"], r["reason"]) for r in failed] == [
        ("ddp", "RuntimeError: forced failure for the test")]  # recorded once, not re-run
    assert sorted(r["config"] for r in report["runs"] if "error" not in r) == [
        "scaleout", "scaleout", "single", "single"]
    assert report["summary"]["scaleout"]["throughput"] > 0
    assert report["summary"]["ddp"]["failed"].startswith("RuntimeError")
    assert report["summary"]["scaleout"]["over_peers"]["ddp"] is None


def test_device_is_validated_and_cpu_runs_hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="device"):
        TrainBenchConfig(workload="digits-mlp", testbed=False, device="tpu")
    cfg = TrainBenchConfig(workload="digits-mlp", testbed=False)
    seen = {}

    def fake_launch(target, config, wrapper=None, out=None):  # noqa: ANN001
        seen.update(config.env)
        return 3

    monkeypatch.setattr(train, "launch", fake_launch)
    with pytest.raises(train.BenchFailed, match="exit code 3"):
        train._run_once(cfg, "ddp", train.Placement(wrapper=None, master_addr="127.0.0.1",
                                                    network={}), "/tmp", None)
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and "--device" in train._worker_args(cfg, "ddp", "x")


def test_warm_ranks_that_do_not_leave_after_their_last_round_are_stopped() -> None:
    """finish() waits a bounded time for the ranks to leave by themselves, then stops them
    and says so (the runner used to wait the whole round timeout: stop 42)."""
    import threading

    from scaleout.bench.train import LEAVE_S
    from scaleout.bench.train_warm import WarmRanks

    assert 0 < LEAVE_S <= 60
    for leaves in (True, False):
        ranks = WarmRanks.__new__(WarmRanks)
        ranks._stop = threading.Event()
        ranks._thread = threading.Thread(
            target=lambda e=ranks._stop, quick=leaves: e.wait(0.05 if quick else 30), daemon=True)
        ranks._thread.start()
        started = time.monotonic()
        assert ranks.finish(1.0) is leaves
        assert not ranks.alive and time.monotonic() - started < 5  # stopped, not waited out


def test_fresh_ranks_that_do_not_exit_after_the_result_are_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A configuration's fresh ranks get LEAVE_S after the first one exited; one that
    outstays it is stopped and the result stands, with a line on stderr. Without a result
    it is a failed configuration. (Stop 43: a DDP rank hung at exit and the runner waited.)"""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import json, os, sys, time
        if os.environ["RANK"] == "0":
            if sys.argv[2] == "result":
                with open(sys.argv[1], "w") as handle:
                    json.dump({"median_iter_s": 1.0}, handle)
        else:
            time.sleep(60)  # finished, yet not exiting
    """))
    cfg = TrainBenchConfig(workload="digits-mlp", testbed=False)
    place = train.Placement(wrapper=None, master_addr="127.0.0.1", network={})
    monkeypatch.setattr(train, "LEAVE_S", 1.0)
    for written in ("result", "nothing"):
        monkeypatch.setattr(train, "_worker_args",
                            lambda _c, _n, path, w=written: [str(worker), path, w])
        started = time.monotonic()
        if written == "result":
            assert train._run_once(cfg, "ddp", place, str(tmp_path), None) == {
                "median_iter_s": 1.0}
            assert "its ranks had not left 1 s after the first one did" in capsys.readouterr().err
        else:
            with pytest.raises(train.BenchFailed, match="exit code 1"):
                train._run_once(cfg, "ddp", place, str(tmp_path), None)
        assert time.monotonic() - started < 20


def test_scaleouts_own_warnings_are_said_once_and_kept_with_the_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A rank's warning from scaleout (its message says so, or scaleout's code raised it)
    reaches the user once per benchmark, and the configuration's results keep it; torch's
    own do not count.
    (Stop 44: DLRM's tables went whole on the device machine, seen only in its MB/it.)"""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import json, os, sys, warnings
        warnings.warn("scaleout: tables travel whole", RuntimeWarning)
        warnings.warn("something of torch's", UserWarning)
        print("/x/site-packages/scaleout/pytorch/optimizer.py:243: UserWarning: the .grad of "
              "w was changed", file=sys.stderr)  # (as a warning from scaleout's code reads)
        if os.environ["RANK"] == "0":
            with open(sys.argv[1], "w") as handle:
                json.dump({"median_iter_s": 1.0}, handle)
    """))
    monkeypatch.setattr(train, "_worker_args", lambda _c, _n, path: [str(worker), path])
    cfg = TrainBenchConfig(workload="digits-mlp", ranks=2, testbed=False)
    place = train.Placement(wrapper=None, master_addr="127.0.0.1", network={})
    said: set[str] = set()
    for _ in range(2):  # two rounds of fresh ranks: said once
        result = train._run_once(cfg, "scaleout", place, str(tmp_path), None, said=said)
        assert result["warnings"] == ["scaleout: tables travel whole",
                                      "the .grad of w was changed"], result
    err = capsys.readouterr().err
    assert err.count("bench train: configuration 'scaleout' warned: scaleout: tables travel "
                     "whole") == 1, err
    assert err.count("warned: the .grad of w was changed") == 1, err
    assert "something of torch's" not in err
