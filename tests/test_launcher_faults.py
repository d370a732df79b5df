"""The launcher owns its ranks: signals stop every rank, ranks die with the launcher, the
rank that failed first is blamed, a missing target is one line. Each case is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import run_command

SRC = str(Path(__file__).parents[1] / "src")

# Every rank writes its pid, then rank 1 freezes (SIGSTOP) and the others ignore SIGTERM
# and sleep: only SIGKILL after the grace period removes them.
FROZEN = """
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)
"""


def start_run(tmp_path: Path, nprocs: int, body: str, run: list[str] | None = None,
              **extra: str) -> subprocess.Popen[str]:
    """``scaleout run -n NPROCS`` of ``body``, or ``run -n NPROCS`` (harness.run_command);
    ``extra``: environment variables."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": SRC, **extra}
    # SIGHUP at its default, as in a terminal, even where this test runs under nohup (a
    # launcher keeps an inherited SIG_IGN: test_launcher_robustness.py's nohup test)
    return subprocess.Popen([*(run or [sys.executable, "-m", "scaleout", "run"]), "-n",
                             str(nprocs), str(script), str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def rank_pids(tmp_path: Path, nprocs: int, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    files = [tmp_path / f"pid{rank}" for rank in range(nprocs)]
    while time.monotonic() < deadline:
        if all(f.exists() and f.read_text() for f in files):
            time.sleep(0.3)  # let rank 1 stop itself and the others install SIG_IGN
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start within {timeout} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (already dead, not yet reaped by its new parent) counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not any(alive(pid) for pid in pids):
            return time.monotonic() - started
        time.sleep(0.05)
    for pid in pids:  # do not leave them behind when the test fails
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"ranks {[p for p in pids if alive(p)]} still alive after {timeout} s")


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_launcher_stops_every_rank(tmp_path: Path, nprocs: int, sig: int) -> None:
    # (a grace period of 1 s rather than 3: the ranks outlive the SIGTERM either way)
    run = start_run(tmp_path, nprocs, FROZEN, run=run_command(settle=5.0, grace=1.0))
    pids = rank_pids(tmp_path, nprocs)
    started = time.monotonic()
    run.send_signal(sig)
    output = run.communicate(timeout=15)[0]
    assert run.returncode == 128 + sig, output
    assert f"got {signal.Signals(sig).name}; stopped every rank" in output
    wait_gone(pids, 2.0)
    assert time.monotonic() - started < 6.0  # 1 s grace, then SIGKILL


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_die_with_a_killed_launcher(tmp_path: Path, nprocs: int) -> None:
    run = start_run(tmp_path, nprocs, FROZEN)
    pids = rank_pids(tmp_path, nprocs)
    run.kill()
    run.wait(timeout=5)
    assert wait_gone(pids, 5.0) < 5.0


def test_parent_watch_is_the_fallback(tmp_path: Path) -> None:
    """Without the parent-death signal a rank still leaves once its launcher is gone."""
    pid_file = tmp_path / "pid"
    child = textwrap.dedent(f"""
        import os, time
        from scaleout.launch.lifeline import watch_parent
        assert watch_parent({{"SCALEOUT_LAUNCHER_PID": str(os.getppid())}}, period=0.1)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}])
        time.sleep(60)
    """)], env={**os.environ, "PYTHONPATH": SRC})
    deadline = time.monotonic() + 15
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    parent.kill()
    parent.wait(timeout=5)
    assert wait_gone([pid], 3.0) < 3.0


def test_the_rank_that_failed_first_is_blamed(tmp_path: Path) -> None:
    """Rank 2 dies (SIGKILL) inside an allreduce loop; the peers then fail with a gloo error
    and exit 1. The launcher names rank 2, not the first rank that noticed."""
    run = start_run(tmp_path, 3, """
        import os, signal, sys, time, torch, scaleout
        env = scaleout.init(timeout=20)
        d = env.create_distribution()
        for step in range(1000):
            if env.rank == 2 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
            time.sleep(0.01)
    """, SCALEOUT_HEARTBEAT="2")  # (the peers notice within 0.4 s, rather than 1 s at 15)
    output = run.communicate(timeout=40)[0]
    assert run.returncode == 128 + signal.SIGKILL, output
    assert "scaleout run: rank 2 failed first, with signal SIGKILL" in output


def test_what_a_failed_rank_started_does_not_outlive_the_job(tmp_path: Path) -> None:
    # each rank starts a child in its process group; rank 1 then exits with code 3 (its
    # child used to be left running: only live ranks' groups were signalled). Rank 0 never
    # ends by itself: stopped after a settle period of 1 s rather than 5.
    run = start_run(tmp_path, 2, """
        import os, subprocess, sys, time
        rank = int(os.environ["RANK"])
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(child.pid))
        time.sleep(1)
        if rank == 1:
            raise SystemExit(3)
        time.sleep(120)
    """, run=run_command(settle=1.0, grace=3.0))
    children = rank_pids(tmp_path, 2)
    output = run.communicate(timeout=40)[0]
    assert run.returncode == 3, output
    wait_gone(children, timeout=5)


def test_missing_target_is_one_line() -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    for target, message in (("no_such_command", "no such command: no_such_command"),
                            ("missing.py", "no such script: missing.py")):
        result = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", target],
                                env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.strip().splitlines() == [f"scaleout run: error: {message} "
                                                      "(expected script.py, -m module or an "
                                                      "executable on PATH)"
                                                      if target == "no_such_command" else
                                                      f"scaleout run: error: {message}"]
