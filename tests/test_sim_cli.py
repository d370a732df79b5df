"""``scaleout sim`` smoke tests: the module entry point once, the rest in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaleout.cli.main import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_python_dash_m_collective_json() -> None:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaleout",
            "sim",
            "collective",
            "--op",
            "allreduce",
            "--algorithm",
            "ring",
            "--topology",
            "8",
            "--bandwidth",
            "100Gbps",
            "--latency",
            "5us",
            "--size",
            "64MB",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    data = json.loads(out)
    # 2 x 7 x (5 us + 8 MB / 12.5 GB/s)
    assert data["time_s"] == pytest.approx(14 * (5e-6 + (64 << 20) / 8 / 12.5e9))
    assert data["npus"] == 8


def test_collective_themis_and_errors(capsys) -> None:
    assert (
        main(
            [
                "sim",
                "collective",
                "--topology",
                "16x16",
                "--bandwidth",
                "100GB/s",
                "--themis",
                "--chunks",
                "16",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["themis"]["gain"] > 1.0
    assert main(["sim", "collective", "--topology", "8x", "--bandwidth", "1Gbps"]) == 2
    assert "8x128" in capsys.readouterr().err
    assert main(["sim", "collective", "--topology", "8", "--bandwidth", "1Gbps",
                 "--size", "1e400"]) == 2  # was an OverflowError's traceback
    assert "size must be finite, got '1e400'" in capsys.readouterr().err
    base = ["sim", "run", "--model", "resnet50", "--device", "p100", "--preset", "goyal-bigbasin"]
    for extra, message in ((["--batch", "0"], "batch_size must be an int >= 1, got 0"),
                           (["--nodes", "0"], "npus must be an int >= 1, got 0")):
        assert main([*base, *extra]) == 2  # 0 was read as "not given": the defaults' answer
        assert message in capsys.readouterr().err


def test_collective_of_nothing_prints_zero_bandwidth_and_valid_json(capsys) -> None:
    for size, topology in (("0", "4"), ("1MB", "1")):
        argv = ["sim", "collective", "--size", size, "--topology", topology, "--bandwidth",
                "100Gbps"]
        assert main(argv) == 0
        assert "0.0ns, algbw 0.000 GB/s, busbw 0.000 GB/s" in capsys.readouterr().out
        assert main([*argv, "--json"]) == 0
        data = json.loads(capsys.readouterr().out, parse_constant=pytest.fail)  # no Infinity
        assert (data["time_s"], data["algbw_GBps"], data["busbw_GBps"]) == (0.0, 0.0, 0.0)


def test_run_writes_chrome_and_chakra_and_runs_chakra(tmp_path, capsys) -> None:
    chrome, prefix = tmp_path / "it.json", tmp_path / "rn"
    assert (
        main(
            [
                "sim",
                "run",
                "--model",
                "resnet50",
                "--preset",
                "goyal-bigbasin",
                "--nodes",
                "64",
                "--chrome",
                str(chrome),
                "--write-chakra",
                str(prefix),
                "--ranks",
                "2",
            ]
        )
        == 0
    )
    assert "efficiency" in capsys.readouterr().out
    assert json.loads(chrome.read_text())["traceEvents"]
    assert (
        main(["sim", "run", "--chakra", f"{prefix}.1.et", "--preset", "goyal-bigbasin", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["nodes"] > 100


def test_sweep_and_trace_workload(tmp_path, capsys) -> None:
    from scaleout.sim.trace import write_trace
    from scaleout.sim.workload import Layer, Workload

    trace = tmp_path / "t.json"
    write_trace(
        trace,
        Workload(
            name="rec",
            batch_size=4,
            layers=(Layer(name="a", forward_s=0.01, backward_s=0.02, grad_bytes=1 << 20),),
        ),
    )
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "sim",
                "sweep",
                "--trace",
                str(trace),
                "--batch",
                "8",
                "--topology",
                "4x8",
                "--bandwidth",
                "10GB/s,10Gbps",
                "--nodes",
                "1..32",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    points = json.loads(out.read_text())["points"]
    assert [p["npus"] for p in points] == [1, 2, 4, 8, 16, 32]
    assert points[0]["efficiency"] == pytest.approx(1.0)
    assert points[0]["compute_s"] == pytest.approx(0.06)  # batch 8 from a trace at batch 4


def _one_layer_run(tmp_path, capsys, option: str, values: tuple[str, ...]) -> list[float]:
    """``sim run`` of a one-layer trace (10 ms forward, 20 ms backward, 1 MiB of gradient)
    on 2 ranks at 8 Mbit/s, sync, FIFO; the iteration time with each ``option`` value."""
    from scaleout.sim.trace import write_trace
    from scaleout.sim.workload import Layer, Workload

    trace = tmp_path / "t.json"
    layer = Layer(name="a", forward_s=0.01, backward_s=0.02, grad_bytes=1 << 20)
    write_trace(trace, Workload(name="rec", batch_size=4, layers=(layer,)))
    args = ["sim", "run", "--trace", str(trace), "--topology", "2", "--bandwidth", "8Mbps",
            "--latency", "0us", "--mode", "sync", "--policy", "fifo", "--json"]
    times = []
    for value in values:
        assert main([*args, option, value]) == 0
        times.append(json.loads(capsys.readouterr().out)["iteration_s"])
    return times


def test_run_host_cost(tmp_path, capsys) -> None:
    times = _one_layer_run(tmp_path, capsys, "--host-cost", ("0", "2"))
    # 2 ranks: the all-reduce moves 1 MiB at 1e6 B/s; with 2 s of CPU per MB it takes 2 s
    assert times == pytest.approx([0.03 + 1.048576, 0.03 + 2.0])


def test_run_cycle(tmp_path, capsys) -> None:
    times = _one_layer_run(tmp_path, capsys, "--cycle", ("0s", "100ms"))
    # the gradient, ready at 30 ms, waits for a cycle: at 100 ms in the first iteration, then
    # 100 ms after the last one's work ended (the steady state: a wait of 70 ms)
    assert times == pytest.approx([0.03 + 1.048576, 0.1 + 1.048576])
    assert main(["sim", "run", "--model", "resnet50", "--cycle", "5 parsecs"]) == 2
    assert "time must look like" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "run", "--help"])
    # the help's default is one --cycle takes (it said "0", which is refused: no unit)
    assert "0s (default): at once" in " ".join(capsys.readouterr().out.split())


def test_validate_prints_sources_writes_json_and_exit_code_matches(tmp_path, capsys) -> None:
    out = tmp_path / "v.json"
    rc = main(["sim", "validate", "--only", "published", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == (0 if report["ok"] else 1)
    text = capsys.readouterr().out
    assert "Horovod" in text and "Goyal" in text and "Themis" in text
    assert all(o["source"] and o["assumptions"] for o in report["outcomes"])


def test_an_output_that_cannot_be_written_is_refused_first(tmp_path, capsys) -> None:
    # (it used to be a traceback, after the run)
    for option in ("--json", "--chrome"):
        command = ["sim", "run", "--model", "resnet50", "--device", "p100", "--preset",
                   "goyal-bigbasin", option, str(tmp_path / "no" / "out.json")]
        assert main(command) == 2
        assert f"{option} {tmp_path / 'no' / 'out.json'}: no folder" in capsys.readouterr().err
    assert main(["sim", "collective", "--topology", "8", "--bandwidth", "1Gbps", "--json",
                 str(tmp_path)]) == 2
    assert "a folder, not a file" in capsys.readouterr().err


def test_a_broken_trace_is_named(tmp_path, capsys) -> None:
    (tmp_path / "trace.0.json").write_text("{not json")
    assert main(["sim", "chrome", str(tmp_path)]) == 2
    assert f"{tmp_path / 'trace.0.json'}: not a scaleout trace" in capsys.readouterr().err
    assert main(["sim", "collective", "--topology", "8x16", "--bandwidth", "100Gbps,25Gbps",
                 "--themis", "--chunks", "100000"]) == 2  # (took minutes)
    assert "chunks must be an int from 1 to 4096" in capsys.readouterr().err


def _trace(tmp_path, grad_bytes: int = 1 << 20) -> str:
    from scaleout.sim.trace import write_trace
    from scaleout.sim.workload import Layer, Workload

    layer = Layer(name="a", forward_s=0.01, backward_s=0.02, grad_bytes=grad_bytes)
    write_trace(tmp_path / "t.json", Workload(name="rec", batch_size=4, layers=(layer,)))
    return str(tmp_path / "t.json")


def _refused(capsys, argv: list[str], message: str) -> None:
    """``argv`` exits 2 with ``message`` on one line of stderr and nothing on stdout."""
    try:
        rc = main(argv)
    except SystemExit as err:  # argparse's own refusals
        rc = err.code
    assert rc == 2, argv
    out, err = capsys.readouterr()
    assert message in err and not out, (argv, err, out)
    assert len([line for line in err.splitlines() if "error" in line]) == 1


@pytest.mark.parametrize(("option", "value"), [
    ("--codec-cost", "nan"), ("--codec-cost", "inf"), ("--host-cost", "inf"),
    ("--codec-ratio", "nan"), ("--speed", "inf"),
])
def test_non_finite_numbers_are_refused(capsys, option: str, value: str) -> None:
    # --codec-cost nan printed a nan iteration and wrote NaN into --json, with exit 0
    _refused(capsys, ["sim", "run", "--model", "resnet50", option, value],
             f"argument {option}: expected a finite number, got '{value}'")


def test_no_option_is_silently_ignored_or_overridden(tmp_path, capsys) -> None:
    trace = _trace(tmp_path)
    model = ["sim", "run", "--model", "resnet50"]
    for network in (["--topology", "16"], ["--bandwidth", "1Gbps"], ["--latency", "1us"],
                    ["--kind", "switch"]):  # the preset's network won, silently
        _refused(capsys, [*model, "--preset", "goyal-bigbasin", *network],
                 f"--preset goyal-bigbasin defines the topology, bandwidths, latencies and kinds: "
                 f"give it without {network[0]}")
    _refused(capsys, [*model, "--topology", ""], "topology must look like '8'")  # was 8
    for command in ("run", "sweep"):  # --speed scaled nothing of a model
        _refused(capsys, ["sim", command, "--model", "resnet50", "--speed", "2"],
                 "--speed applies to --trace")
    _refused(capsys, ["sim", "run", "--trace", trace, "--device", "h100"],
             "--device applies to --model")
    _refused(capsys, ["sim", "run", "--trace", trace, "--speed", "0"],
             "--speed must be a finite number > 0, got 0.0")
    # --codec-* replaced the named codec by one of ratio 1
    _refused(capsys, [*model, "--codec", "blockquant", "--codec-gather"],
             "--codec blockquant is a measured codec (its own ratio and cost) and --codec-gather "
             "are for a codec not measured here")
    assert main([*model, "--codec-gather", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_s"] > 0
    # --themis took the first algorithm and ignored --flat
    themis = ["sim", "collective", "--topology", "8x8", "--themis"]
    for extra in (["--flat"], ["--algorithm", "ring,direct"]):
        _refused(capsys, [*themis, *extra],
                 "a pipelined all-reduce takes one algorithm and no flat ring")
    assert main([*themis, "--algorithm", "direct,direct", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["themis"]["gain"] > 0
    _refused(capsys, [*model, "--ranks", "2"], "--ranks applies to --chrome and --write-chakra")
    # one collective took --chunks and priced it unchunked
    _refused(capsys, ["sim", "collective", "--chunks", "8"], "--chunks applies to --themis")
    assert main([*themis, "--chunks", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["themis"]["chunks"] == 8


def test_a_chakra_trace_refuses_what_it_records(tmp_path, capsys) -> None:
    # the trace's graph ran as recorded and the workload's options were dropped silently
    prefix = str(tmp_path / "rn")
    assert main(["sim", "run", "--model", "resnet50", "--write-chakra", prefix]) == 0
    capsys.readouterr()
    chakra = ["sim", "run", "--chakra", f"{prefix}.0.et"]
    for extra in (["--batch", "64"], ["--policy", "fifo"], ["--mode", "sync"],
                  ["--bucket", "1MB"], ["--codec", "blockquant"], ["--pipeline", "themis"],
                  ["--pipeline-chunks", "4"], ["--codec-ratio", "0.5"], ["--codec-gather"],
                  ["--host-cost", "0.1"], ["--cycle", "5ms"], ["--write-chakra", prefix]):
        _refused(capsys, [*chakra, *extra],
                 f"--chakra runs the trace's own graph (its batch, buckets, codec and order are "
                 f"recorded in it): {extra[0]} does not apply to it")
    _refused(capsys, [*chakra, "--batch", "8", "--mode", "sync"], "--batch, --mode do not")
    assert main([*chakra, "--policy", "priority", "--json"]) == 0  # the defaults, said again
    assert json.loads(capsys.readouterr().out)["nodes"] > 100


def test_nothing_non_finite_is_printed(capsys) -> None:
    collective = ["sim", "collective", "--topology", "8"]
    _refused(capsys, [*collective, "--bandwidth", "1e-300bps"],  # printed infs and Infinity
             "bandwidth must be at least 1 bit/s (0.125 bytes/s)")
    assert main([*collective, "--bandwidth", "1bps", "--json"]) == 0
    assert json.loads(capsys.readouterr().out, parse_constant=pytest.fail)["time_s"] > 0
    # a time that overflows a float: refused whole, not printed
    _refused(capsys, ["sim", "collective", "--topology", "1000", "--size", "1e306", "--json"],
             "a result is not a finite number")
    _refused(capsys, ["sim", "run", "--model", "resnet50", "--device", "inf"],
             "device rate must be a finite number > 0 FLOP/s, got inf")


def test_a_plan_too_big_to_simulate_is_refused_at_once(tmp_path, capsys) -> None:
    # 100 TB of gradients in 2 MiB chunks: it ran for ever (one tuple entry, one event each)
    trace = _trace(tmp_path, grad_bytes=10**14)
    started = time.perf_counter()
    _refused(capsys, ["sim", "run", "--trace", trace, "--topology", "4", "--bandwidth", "10Gbps"],
             "47683716 chunks of partition_bytes=2097152: at most 1048576")
    assert time.perf_counter() - started < 30
    # whole buckets (FIFO) are one chunk whatever their size
    assert main(["sim", "run", "--trace", trace, "--topology", "4", "--bandwidth", "10Gbps",
                 "--policy", "fifo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_s"] == pytest.approx(
        0.11 + 2 * 3 / 4 * 10**14 / 1.25e9, rel=1e-3)


def test_chrome_tracks_are_ranks_of_the_topology(tmp_path, capsys) -> None:
    chrome = tmp_path / "c.json"
    run = ["sim", "run", "--model", "resnet50", "--chrome", str(chrome)]
    _refused(capsys, [*run, "--ranks", "100000"],  # (took minutes)
             "--ranks must be from 1 to the topology's 8 NPUs, got 100000")
    assert main([*run, "--topology", "2"]) == 0  # the default 4 tracks, of 2 NPUs: 2
    capsys.readouterr()
    events = json.loads(chrome.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
