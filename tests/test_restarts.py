"""``scaleout run --max-restarts K``: a job that loses a rank restarts every rank and, resuming
from its checkpoint, ends with the weights of an uninterrupted run; a spent budget fails
naming the rank. Each run is bounded in time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from harness import run_command, run_ranks

SRC = str(Path(__file__).parents[1] / "src")

JOBS = str(Path(__file__).parent / "restart_jobs.py")


def scaleout_run(*args: str, timeout: float = 90, run: list[str] | None = None,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC, **(env or {})}
    return subprocess.run([*(run or [sys.executable, "-m", "scaleout", "run"]), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def digests(stdout: str) -> list[str]:
    return re.findall(r"\[rank \d\] final weights=([0-9a-f]{64})", stdout)


def test_killed_rank_restarts_and_ends_bit_identical(tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself before step 7 (checkpoint at step 6) on the first attempt; the
    restarted job resumes at step 6 and ends with the uninterrupted run's weights (that
    reference comes from the same job run by the forked harness)."""
    from restart_jobs import checkpointed

    reference = run_ranks(2, checkpointed, str(tmp_path / "reference"), -1, timeout=60)
    assert len(set(reference)) == 1
    # (heartbeat limit 2 s, not 15: rank 0 names rank 1 and leaves sooner)
    killed = scaleout_run("-n", "2", "--max-restarts", "2", JOBS, "checkpointed",
                          str(tmp_path / "killed"), "7", env={"SCALEOUT_HEARTBEAT": "2"})
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "rank 1 failed first, with signal SIGKILL" in killed.stdout
    assert "restart 1 of 2: starting every rank again" in killed.stdout
    assert "[rank 0] attempt 1 starts at step 6" in killed.stdout
    assert ("every rank finished after 1 restart (attempt 0: rank 1 failed first, with "
            "signal SIGKILL)") in killed.stdout
    assert digests(killed.stdout) == reference, (reference, killed.stdout)


FAILING = """
    import os, sys, time
    env = os.environ
    print("attempt", env["SCALEOUT_RESTART_COUNT"], "of", env["SCALEOUT_MAX_RESTARTS"],
          "state", os.path.isdir(env["SCALEOUT_STATE_DIR"]))
    if env["RANK"] == "1":
        sys.exit(3)
    time.sleep(60)
"""


def test_spent_budget_fails_naming_the_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAILING))
    started = time.monotonic()
    # rank 0 never ends by itself: each attempt waits out the launcher's settle period before
    # rank 0 is stopped, here 1 s rather than 5 (harness.run_command)
    result = scaleout_run("-n", "2", "--max-restarts", "2", str(script), timeout=60,
                          run=run_command(settle=1.0, grace=1.0))
    assert time.monotonic() - started < 30
    assert result.returncode == 3, result.stdout + result.stderr
    for attempt in range(3):
        assert f"[rank 1] attempt {attempt} of 2 state True" in result.stdout
    assert result.stdout.count("rank 1 failed first, with exit code 3; stopped the other") == 3
    assert ("gave up after 2 restarts (--max-restarts 2 spent): attempt 0: rank 1 failed "
            "first, with exit code 3; attempt 1:") in result.stdout


def test_restart_options_are_checked() -> None:
    result = scaleout_run("-n", "1", "--max-restarts", "-1", "x.py", timeout=30)
    assert result.returncode == 2 and "max_restarts must be an int >= 0" in result.stderr
    result = scaleout_run("-n", "1", "--nnodes", "2", "--master-port", "29999",
                          "--max-restarts", "1", "x.py", timeout=30)
    assert result.returncode == 2
    assert "--max-restarts works on a single node only" in result.stderr
    assert result.stderr.count("\n") == 1


def test_signal_to_the_launcher_is_not_retried(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('up', os.environ['SCALEOUT_RESTART_COUNT'])\n"
                      "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "scaleout", "run", "-n", "2",
                             "--max-restarts", "3", str(script)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for _ in range(2):  # both ranks are up
        assert proc.stdout.readline().endswith("up 0\n")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 143, out
    assert "got SIGTERM; stopped every rank" in out and "restart" not in out
