"""Defects found in a bug hunt of the testbed (stop 51), each pinned by a test that failed
before its fix. Tests needing root and iproute2 skip without them (fail under ``CI=true``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scaleout.cli.main import main
from scaleout.testbed import Testbed, TestbedConfig, attach_wrapper, list_testbeds
from scaleout.testbed.state import owner_alive, process_start_time
from scaleout.testbed.system import System

from harness import require_testbed

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _name(tag: str) -> str:
    return f"{tag}{os.getpid() % 100000}"


@pytest.fixture
def state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state directory, so tests never see a user's testbeds."""
    monkeypatch.setenv("SCALEOUT_TESTBED_DIR", str(tmp_path))
    return tmp_path


def test_calibrate_refuses_a_lone_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: busbw 0 (factor 2(n-1)/n), then ZeroDivisionError and a traceback.
    assert main(["testbed", "calibrate", "--ranks", "1", "--name", "none"]) == 2
    assert "--ranks: expected an integer >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("rate", ["1bit", "1kbit", "2tbit"])
def test_rate_tbf_cannot_shape_is_refused(rate: str) -> None:
    # Before: tc's usage text (1bit), a limit tc refused (4tbit), or at 1kbit a bucket of
    # 31190 bytes instead of 65550 (the kernel's tick count wrapped), all silently up.
    with pytest.raises(ValueError, match="rate: expected 10kbit to 1tbit"):
        TestbedConfig(hosts=1, rate=rate)


def test_an_unreaped_owner_is_gone() -> None:
    # Before: a zombie's /proc/PID/stat still held its start time, so its testbed was live.
    child = subprocess.Popen(["sleep", "0.1"])
    start = process_start_time(child.pid)
    assert owner_alive(child.pid, start)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        assert not owner_alive(child.pid, start)
    finally:
        child.wait()


@pytest.mark.testbed
def test_nodes_of_a_testbed_job_get_hosts_of_their_own(state_directory: Path) -> None:
    # Before: `scaleout run --testbed T -n 1 --nnodes 2 --node-rank 1` put rank 1 on host 0.
    require_testbed()
    name = _name("hn")
    with Testbed(TestbedConfig(hosts=2, rate="1gbit", name=name)):
        namespaces = [attach_wrapper(name, 1, nnodes=2, node_rank=node)[0](0)[0][-1]
                      for node in (0, 1)]
        assert namespaces == [f"so-{name}-h0", f"so-{name}-h1"]
        with pytest.raises(ValueError, match="is 4 ranks"):
            attach_wrapper(name, 2, nnodes=2, node_rank=1)


@pytest.mark.testbed
def test_sigterm_during_up_leaves_nothing(state_directory: Path) -> None:
    # Before: 3 of 7 namespaces and the state file stayed until the next up or down.
    require_testbed()
    name = _name("ht")
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaleout", "testbed", "up", "--hosts", "12", "--rate", "1gbit",
         "--name", name], env={**os.environ, "PYTHONPATH": SRC}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (state_directory / f"{name}.json").exists():  # written before the first netns
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    left = [ns for ns in System().namespaces() if ns.startswith(f"so-{name}-")]
    states = list_testbeds()
    main(["testbed", "down", "--name", name])  # whatever the outcome
    if proc.returncode == 0:  # (up had finished: nothing to test)
        pytest.skip("up finished before SIGTERM arrived")
    assert (proc.returncode, left, states) == (128 + signal.SIGTERM, [], []), err
    assert "stopped by SIGTERM" in err
