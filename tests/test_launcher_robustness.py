"""The launcher under rough conditions: a reader of its output that leaves, a rank writing one
huge line, ``kill -9`` of the launcher with processes below the ranks, ``nohup``, a rank
that leaves early. Each job is a small script without torch; each case is bounded."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from scaleout.launch.launcher import LaunchConfig, launch
from scaleout.launch.lifeline import LAUNCHER_ID_VAR, LAUNCHER_PID_VAR, watch_parent
from scaleout.launch.ranks import PIECE, TAIL_LINE

SRC = str(Path(__file__).parents[1] / "src")
MARK = "SCALEOUT_TEST_MARK"


def write_job(tmp_path: Path, body: str) -> Path:
    script = tmp_path / f"job_{uuid.uuid4().hex}.py"  # (a unique name: a marker in ps)
    script.write_text(textwrap.dedent(body))
    return script


def start_run(target: list[str], mark: str = "", **options: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC, MARK: mark}
    return subprocess.Popen([sys.executable, "-m", "scaleout", "run", "-n", "2", *target],
                            env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **options)


def wait_files(paths: list[Path], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() and path.read_text() for path in paths):
        assert time.monotonic() < deadline, f"not written within {timeout} s: {paths}"
        time.sleep(0.05)


def marked(mark: str) -> list[int]:
    """Live processes (zombies excluded) whose command line or environment holds ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in text and state not in "ZX":
            found.append(int(entry.name))
    return found


def assert_all_gone(mark: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked(mark)
    for pid in left:  # do not leave them behind when the test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the job still alive {timeout} s after: {left}"


# -- 1. the launcher's reader leaves (`scaleout run ... | head -2`) --------------------------

CHATTY = """
    import os, sys
    for i in range(20000):  # 2 MB per rank: far more than a pipe holds
        print(f"item {i} " + "x" * 100, flush=True)
    open(os.path.join(sys.argv[1], f"done{os.environ['RANK']}"), "w").write("1")
    sys.exit(3 if os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.parametrize("failing", [False, True])
def test_a_reader_that_leaves_does_not_hang_the_job(tmp_path: Path, failing: bool) -> None:
    script = write_job(tmp_path, CHATTY if failing else CHATTY.replace("3 if", "0 if"))
    run = start_run([str(script), str(tmp_path)])
    assert run.stdout is not None and run.stderr is not None
    for _ in range(2):
        assert run.stdout.readline().startswith("[rank ")
    run.stdout.close()  # as `head -2` does
    try:
        code = run.wait(timeout=20)
    finally:
        run.kill()
    errors = run.stderr.read()
    assert code == (3 if failing else 0), errors
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()


# -- 2. one huge line -------------------------------------------------------------------------

class Counting:
    """An output stream that keeps the size of every write and a little of the text."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.sizes.append(len(text))
        if not text.startswith("[rank 1] yyy"):  # (the line's pieces)
            self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_huge_line_is_passed_on_in_pieces(tmp_path: Path) -> None:
    megabytes = 64
    script = write_job(tmp_path, f"""
        import os, sys
        if os.environ["RANK"] == "1":
            for _ in range({megabytes}):
                sys.stdout.write("y" * (1 << 20))  # one line of {megabytes} MB, no newline yet
            sys.stdout.write("\\n")
            sys.exit(3)
        print("done", flush=True)
    """)
    out = Counting()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = launch([str(script)], LaunchConfig(nprocs=2, settle=1.0, grace=1.0), out=out)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert code == 3
    assert max(out.sizes) <= PIECE + len("[rank 1] \n")
    assert sum(out.sizes) >= megabytes << 20
    assert grown_mb < 32, f"the launcher grew by {grown_mb:.0f} MB"
    report = "".join(out.text)
    assert "[rank 0] done" in report
    tail = [line for line in report.splitlines() if line.startswith("    y")]
    assert len(tail) == 1 and len(tail[0]) < TAIL_LINE + 100, "the tail keeps a cut line"


# -- 3. kill -9 of the launcher: what the ranks started goes too -------------------------------

STARTS_A_SESSION = """
    import os, subprocess, sys
    # a helper in a session of its own (a daemon's way): in no group the launcher stops
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(child.pid))
    sys.exit(3 if sys.argv[2] == "fail" and os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.parametrize("ending", ["ok", "fail"])
def test_what_ranks_started_in_a_session_of_its_own_ends_with_the_job(
        tmp_path: Path, ending: str) -> None:
    """The launcher is the subreaper of its ranks' descendants (launch/subreaper.py): the
    sleeps, orphaned when their ranks exit, come to it and end with the job (before stop
    24 they ran on, re-parented to init)."""
    mark = uuid.uuid4().hex
    run = start_run([str(write_job(tmp_path, STARTS_A_SESSION)), str(tmp_path), ending], mark)
    try:
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == (3 if ending == "fail" else 0), err
    sleeps = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    assert_all_gone(mark, timeout=5.0)
    for pid in sleeps:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(
            f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0], pid

STARTS_A_CHILD = """
    import os, subprocess, sys, time
    from scaleout.launch.lifeline import watch_parent
    watch_parent(os.environ, period=0.2)  # as scaleout.init() does
    # a helper the rank started; in a session of its own with a third argument
    child = subprocess.Popen(["sleep", "300"], start_new_session=len(sys.argv) > 2)
    open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write(str(child.pid))
    time.sleep(120)
"""


@pytest.mark.parametrize("how", ["child", "wrapped", "session"])
def test_what_ranks_started_dies_with_a_killed_launcher(tmp_path: Path, how: str) -> None:
    """``session``: the helper leaves the rank's process group, so only the guardian's search
    by the launcher's identity finds it (before stop 25 it went on, under init)."""
    mark = uuid.uuid4().hex
    script = write_job(tmp_path, STARTS_A_CHILD)
    target = [str(script), str(tmp_path), *(["session"] if how == "session" else [])]
    if how == "wrapped":  # a wrapper that does not exec: the rank is its child, not the launcher's
        target = ["sh", "-c", f"{sys.executable} -u {script} {tmp_path}; echo done"]
    run = start_run(target, mark)
    try:
        wait_files([tmp_path / "pid0", tmp_path / "pid1"])
        assert len(marked(mark)) >= 5  # launcher, 2 ranks, 2 sleeps (and the wrappers)
    finally:
        run.kill()
        run.communicate(timeout=10)
    assert_all_gone(mark, timeout=10.0)


def test_the_launcher_watch_sees_through_a_wrapper(tmp_path: Path) -> None:
    """Without the parent-death signal and the guardian: the rank under ``sh -c`` watches
    the launcher by identity and takes its process group (its wrapper, its child) along."""
    mark = uuid.uuid4().hex
    child = write_job(tmp_path, """
        import os, subprocess, sys, time
        from scaleout.launch.lifeline import watch_parent
        assert watch_parent(os.environ, period=0.1)
        child = subprocess.Popen(["sleep", "300"])
        open(os.path.join(sys.argv[1], "pid"), "w").write(str(child.pid))
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, time
        from scaleout.launch.lifeline import launcher_env
        subprocess.Popen(["sh", "-c", "{sys.executable} -u {child} {tmp_path}; echo done"],
                         env={{**os.environ, **launcher_env()}}, start_new_session=True)
        time.sleep(120)
    """)], env={**os.environ, "PYTHONPATH": SRC, MARK: mark})
    try:
        wait_files([tmp_path / "pid"])
        assert len(marked(mark)) == 4  # the launcher, sh, the rank, sleep
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert_all_gone(mark, timeout=3.0)


def test_a_reused_launcher_pid_is_not_the_launcher(tmp_path: Path) -> None:
    assert watch_parent({LAUNCHER_PID_VAR: str(os.getpid()),
                         LAUNCHER_ID_VAR: "another-boot/pid:[1]/123"}) is None
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from scaleout.launch import lifeline
        identity = lifeline._identity(os.getppid())
        assert identity
        stale = identity.rsplit("/", 1)[0] + "/1"  # same place, another start time
        assert lifeline.watch_parent({{"{LAUNCHER_PID_VAR}": str(os.getppid()),
                                       "{LAUNCHER_ID_VAR}": stale}}, period=0.1)
        time.sleep(10)
    """)], env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True, timeout=20,
        start_new_session=True)
    assert probe.returncode == -signal.SIGKILL, probe.stderr
    assert "the launcher (pid" in probe.stderr


# -- 4. nohup ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_inherited_ignored_stays_ignored(tmp_path: Path, sig: int) -> None:
    script = write_job(tmp_path, """
        import os, sys, time
        open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w").write("1")
        time.sleep(2)
        print("finished", flush=True)
    """)
    run = start_run([str(script), str(tmp_path)],
                    preexec_fn=lambda: signal.signal(sig, signal.SIG_IGN))  # as nohup does
    try:
        wait_files([tmp_path / "pid0", tmp_path / "pid1"])
        run.send_signal(sig)
        output, errors = run.communicate(timeout=20)
    finally:
        run.kill()
    assert run.returncode == 0, output + errors
    assert output.count("finished") == 2 and "got SIG" not in output


# -- 5. a rank that leaves early is named ------------------------------------------------------

@pytest.mark.parametrize("later", [0, 1])
def test_a_rank_that_left_early_is_named(tmp_path: Path, later: int) -> None:
    script = write_job(tmp_path, f"""
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(0)  # leaves in the middle of training
        time.sleep(1.5)  # rank 0 keeps running (as when it evaluates after the others)
        print("rank 0 still ran", flush=True)
        sys.exit({later})  # then fails (a collective with the departed rank would)
    """)
    run = start_run([str(script)])
    output, errors = run.communicate(timeout=20)
    assert run.returncode == later, output + errors
    assert "[rank 0] rank 0 still ran" in output
    if later:
        assert "rank 0 failed first, with exit code 1" in output
        assert re.search(r"rank 1 had exited \(code 0\) \d+\.\d s before rank 0 failed: a "
                         "rank that leaves while others still communicate makes them fail",
                         output), output
    else:
        assert "had exited" not in output


# -- 6. a rank that finished but does not exit: stopped after `linger`, when asked -------------

LINGERS = """
    import os, sys, time
    if os.environ["RANK"] == "1":
        time.sleep({rank1_s})  # done, yet still here (a teardown that hangs)
    print("finished", flush=True)
"""


@pytest.mark.parametrize("linger", [None, 1.0])
def test_a_rank_that_does_not_exit_after_a_clean_exit(tmp_path: Path,
                                                      linger: float | None) -> None:
    script = write_job(tmp_path, LINGERS.format(rank1_s=3.0))
    out = Counting()
    started = time.monotonic()
    code = launch([str(script)], LaunchConfig(nprocs=2, grace=1.0, linger=linger), out=out)
    took = time.monotonic() - started
    report = "".join(out.text)
    if linger is None:  # waited: a rank 0 that evaluates after the others left is common
        assert code == 0 and report.count("finished") == 2 and took >= 3.0, report
    else:
        assert code == 1 and took < 3.0, report
        assert ("scaleout run: not exiting: rank 1 still running 1 s after rank 0 exited with "
                "code 0 (done, yet not exiting: a hang at teardown?); stopped it") in report
        assert "failed first" not in report  # (rank 1's SIGTERM is not a failure of its own)


def test_linger_from_the_command_line(tmp_path: Path) -> None:
    run = start_run(["--linger", "0.5", str(write_job(tmp_path, LINGERS.format(rank1_s=20)))])
    output, errors = run.communicate(timeout=20)
    assert run.returncode == 1, output + errors
    assert "not exiting: rank 1 still running 0.5 s after rank 0 exited" in output + errors


def test_a_rank_that_exits_within_linger_is_no_failure(tmp_path: Path) -> None:
    script = write_job(tmp_path, LINGERS.format(rank1_s=0.5))
    out = Counting()
    assert launch([str(script)], LaunchConfig(nprocs=2, linger=10.0), out=out) == 0
    assert "not exiting" not in "".join(out.text)


@pytest.mark.parametrize("linger", [-1.0, float("inf"), True, "5"])
def test_linger_must_be_seconds(linger: object) -> None:
    with pytest.raises(ValueError, match="linger must be a finite number of seconds"):
        LaunchConfig(nprocs=1, linger=linger)  # type: ignore[arg-type]


def test_the_other_nodes_get_the_same_linger() -> None:
    from scaleout.launch.launcher import node_command

    config = LaunchConfig(nprocs=2, nnodes=2, master_addr="node0", master_port=29500,
                          env={"SCALEOUT_JOB_TOKEN": "secret"}, linger=30.0)
    assert node_command(["train.py"], config, 1).endswith("--linger 30 train.py")
    assert "--linger" not in node_command(["train.py"], LaunchConfig(
        nprocs=2, nnodes=2, master_addr="node0", master_port=29500,
        env={"SCALEOUT_JOB_TOKEN": "secret"}), 1)
