"""Failure detection: a frozen, stopped or killed rank is named by every survivor within the
heartbeat limit (not the collective timeout), and the launcher blames it. Each case bounded."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import run_command

SRC = str(Path(__file__).parents[1] / "src")

JOB = """
    import os, signal, sys, time, torch, scaleout
    from scaleout.core.errors import PeerFailedError
    if os.environ.get("FAKE_MACHINES"):  # as if every rank ran on its own host: no /proc view
        import scaleout.core.watchdog as wd, scaleout.launch.rendezvous as rv
        wd.machine = rv.machine = lambda: "host-" + os.environ["RANK"]
    # The launcher gives the others 5 s (LaunchConfig.settle; 2 s in a stopped rank's job:
    # STOPPED_RUN) after the first failure; ignoring its SIGTERM adds the grace period (3 s;
    # 1 s) to report what they found, before SIGKILL.
    if not os.environ.get("KEEP_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = scaleout.init(timeout=120)  # far longer than the heartbeat limit
    d = env.create_distribution()
    victim, how = int(os.environ["VICTIM"]), os.environ["HOW"]
    last = time.monotonic()
    for step in range(100000):
        if env.rank == victim and step == 20:
            if how == "exit":  # marks itself as left at exit, as a finished rank does
                sys.exit(3)
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        try:
            d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
        except PeerFailedError as err:
            print(f"DETECTED failed_rank={err.failed_rank} after={time.monotonic() - last:.2f} "
                  f"| {err}", flush=True)
            sys.exit(1)  # (rank 0 lingers at exit so that the others can read the failure)
        last = time.monotonic()
        time.sleep(0.01)
"""


#: A stopped rank never exits: its job waits out the launcher's settle and grace periods (5 s,
#: then 3 s) after the first failure. 2 s and 1 s still leave the survivors 3 s to say who
#: failed, which each does within a second of the first (0.4-0.6 s apart in runs here).
STOPPED_RUN = run_command(settle=2.0, grace=1.0)


def run_job(tmp_path: Path, nprocs: int, victim: int, how: str, limit: float,
            fake_machines: bool = False, keep_sigterm: bool = False,
            ) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run JOB; a stopped victim's with the shorter periods of STOPPED_RUN."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {**os.environ, "PYTHONPATH": SRC, "VICTIM": str(victim), "HOW": how,
           "SCALEOUT_HEARTBEAT": str(limit)}
    if fake_machines:
        env["FAKE_MACHINES"] = "1"
    if keep_sigterm:
        env["KEEP_SIGTERM"] = "1"
    started = time.monotonic()
    run = STOPPED_RUN if how == "stop" else [sys.executable, "-m", "scaleout", "run"]
    result = subprocess.run([*run, "-n", str(nprocs), str(script)], env=env,
                            capture_output=True, text=True, timeout=90)
    return result, time.monotonic() - started


def detections(output: str) -> dict[int, tuple[int, float]]:
    """rank -> (failed rank it named, seconds from its last good step to the error)."""
    found = {}
    for rank, failed, after in re.findall(
            r"\[rank (\d+)\] DETECTED failed_rank=(\d+) after=([\d.]+)", output):
        found[int(rank)] = (int(failed), float(after))
    return found


@pytest.mark.parametrize("nprocs,victim,how", [
    (2, 1, "stop"), (3, 2, "stop"), (3, 0, "stop"), (3, 1, "kill"), (3, 1, "exit"),
])
def test_survivors_name_the_failed_rank(tmp_path: Path, nprocs: int, victim: int,
                                        how: str) -> None:
    result, _ = run_job(tmp_path, nprocs, victim, how, limit=2.0)
    out = result.stdout
    survivors = [r for r in range(nprocs) if r != victim]
    found = detections(out)
    if victim == 0 and how == "stop":
        # the store lives in rank 0's stopped process: only its watcher (the last rank)
        # names it within the limit; the others would after it, but the launcher stops them
        survivors = [nprocs - 1]
        assert set(found) >= set(survivors), out + result.stderr
    else:
        assert sorted(found) == survivors, out + result.stderr
    assert all(failed == victim for failed, _ in found.values()), out  # whoever spoke, named it
    for rank in survivors:
        failed, after = found[rank]
        assert after < 2.0 + 3.0, out  # the heartbeat limit (2 s) + slack, never the 120 s timeout
    assert f"scaleout run: rank {victim} failed first" in out, out
    assert result.returncode != 0


def test_every_survivor_names_the_failed_rank_before_it_is_stopped(tmp_path: Path) -> None:
    """Ranks that take the launcher's SIGTERM: the launcher waits (settle) until the
    survivors have said who failed and ended, instead of stopping them at the first exit."""
    result, _ = run_job(tmp_path, 3, 1, "kill", limit=2.0, keep_sigterm=True)
    out = result.stdout
    found = detections(out)
    assert sorted(found) == [0, 2], out + result.stderr
    assert all(failed == 1 for failed, _ in found.values()), out
    assert "scaleout run: rank 1 failed first" in out, out


def test_heartbeat_names_a_frozen_remote_rank(tmp_path: Path) -> None:
    """Without a /proc view of the peer (another host), the heartbeat alone names it."""
    result, _ = run_job(tmp_path, 3, 1, "stop", limit=2.0, fake_machines=True)
    out = result.stdout
    found = detections(out)
    assert sorted(found) == [0, 2], out + result.stderr
    assert all(failed == 1 for failed, _ in found.values()), out
    assert all(2.0 <= after < 2.0 + 4.0 for _, after in found.values()), out
    assert "no heartbeat for" in out + result.stderr
    assert "scaleout run: rank 1 failed first" in out


def test_a_process_stopped_for_a_moment_is_not_reported_as_stopped() -> None:
    """``/proc`` says "stopped" while a profiler samples a rank (``py-spy``: ``t``) or a
    signal holds it for a moment: only a stop that lasts is reported (before, one read was)."""
    import signal
    import threading

    from scaleout.core.failures import STOP_CONFIRM_S, process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        assert process_state(child.pid) is None
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.05)
        threading.Timer(0.05, os.kill, (child.pid, signal.SIGCONT)).start()
        assert process_state(child.pid) is None  # (resumed 50 ms into the check)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.05)
        started = time.monotonic()
        assert process_state(child.pid) == "process stopped (SIGSTOP)"
        assert time.monotonic() - started >= STOP_CONFIRM_S
        child.kill()
        child.wait()
        assert process_state(child.pid) == "process exited"
    finally:
        child.kill()
        child.wait()


def test_a_rank_a_profiler_samples_is_not_named(tmp_path: Path) -> None:
    """A rank stopped 20 ms in every 50 for 3 s (a sampling profiler stops its target for
    moments like these) while two ranks train with a 1 s heartbeat limit: the job ends
    normally. Before, a watchdog read of ``/proc`` during one of those moments named it at
    once: "rank 1 failed: process stopped (SIGSTOP) (noticed by rank 0, 0.2 s after ...)"."""
    script = tmp_path / "sampled.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time, torch, scaleout
        BLINK = ("import os, signal, sys, time\\n"
                 "for _ in range(60):\\n"
                 "    os.kill(int(sys.argv[1]), signal.SIGSTOP); time.sleep(0.02)\\n"
                 "    os.kill(int(sys.argv[1]), signal.SIGCONT); time.sleep(0.03)\\n")
        env = scaleout.init(timeout=60)
        d = env.create_distribution()
        if env.rank == 1:
            sampler = subprocess.Popen([sys.executable, "-c", BLINK, str(os.getpid())])
        for step in range(200):
            d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
            time.sleep(0.01)
        if env.rank == 1:
            print("sampler", sampler.wait(), flush=True)
        env.finalize()
        print("done", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "1"}
    result = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
                            env=env, capture_output=True, text=True, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "failed" not in out, out
    assert out.count("done") == 2 and "sampler 0" in out, out


def _suspended(script: Path, tmp_path: Path, seconds: float) -> tuple[int, str]:
    """Run ``script`` on 2 ranks (heartbeat limit 1 s); once both have written their pid to
    ``tmp_path/pid.<rank>``, stop the whole job for ``seconds`` and resume it (as Slurm's
    ``scontrol suspend``/``resume`` do), then create ``tmp_path/resumed``. Its exit status
    and output."""
    import signal

    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "1"}
    job = subprocess.Popen([sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = [int((tmp_path / f"pid.{rank}").read_text()) for rank in range(2)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        (tmp_path / "resumed").touch()
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    return job.returncode, out


def test_a_job_suspended_and_resumed_whole_is_not_failing(tmp_path: Path) -> None:
    """Every rank stopped for 3 s and resumed (a scheduler suspending the job: Slurm's
    ``scontrol suspend``, gang scheduling's time slices) with a 1 s heartbeat limit: the job
    ends normally. Before, the first look after the resume saw every clock 3 s ahead and
    named a rank: "rank 0 failed: its store (in rank 0's process) stopped answering for
    3.1 s" (2 runs of 2)."""
    script = tmp_path / "suspended.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, torch, scaleout
        env = scaleout.init(timeout=60)
        d = env.create_distribution()
        resumed, seen = os.path.join({str(tmp_path)!r}, "resumed"), None
        for step in range(100000):
            if step == 20:
                with open(os.path.join({str(tmp_path)!r}, f"pid.{{env.rank}}"), "w") as f:
                    f.write(str(os.getpid()))
            flag = torch.tensor([float(os.path.exists(resumed))])
            if d.allreduce(flag, group=scaleout.GroupType.DATA).wait().item() > 0:
                seen = step if seen is None else seen
            if seen is not None and step == seen + 150:  # (> 2 s, 2 limits, after the
                break  # resume; every rank leaves after the same allreduce)
            time.sleep(0.01)
        env.finalize()
        print("done", flush=True)
    """))
    returncode, out = _suspended(script, tmp_path, 3.0)
    assert returncode == 0 and "failed" not in out, out
    assert out.count("done") == 2, out


def test_a_suspension_longer_than_a_wait_under_way_is_named_as_its_cause(tmp_path: Path) -> None:
    """The job stopped whole for 3.5 s while rank 0 waits on rank 1 under a 2 s timeout: the
    wait cannot survive it (gloo's own receive times out at the resume as well), but its
    error says this process was stopped rather than blaming a peer. Before: "did not complete
    within 2 s (a peer rank may have died, diverged, or called a different operation)"."""
    script = tmp_path / "suspended.py"
    script.write_text(textwrap.dedent(f"""
        import os, threading, time, torch, scaleout
        env = scaleout.init(timeout=2)
        d = env.create_distribution()
        d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
        def mark():
            with open(os.path.join({str(tmp_path)!r}, f"pid.{{env.rank}}"), "w") as f:
                f.write(str(os.getpid()))
        if env.rank == 0:
            threading.Timer(0.3, mark).start()  # rank 0 is in its wait by then
        else:
            mark()
            time.sleep(1.2)  # < the timeout: without the stop, rank 0's wait ends in time
        d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
        env.finalize()
        print("done", flush=True)
    """))
    returncode, out = _suspended(script, tmp_path, 3.5)
    assert returncode != 0, out
    found = re.search(r"rank 0: allreduce on group .+? did not complete within 2 s \(this process "
                      r"did not run for (\d+\.\d) s of that time", out)
    assert found and 2.5 <= float(found.group(1)) <= 4.0, out


def test_finishing_at_different_times_is_not_failing(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time, torch, scaleout
        env = scaleout.init(timeout=60)
        d = env.create_distribution()
        d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait()
        if env.rank == 0:
            time.sleep(3.5)  # > 2 heartbeat limits while rank 1 already waits in finalize
        env.finalize()
        print("done", flush=True)
        os._exit(0)
    """))
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "1.5"}
    result = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "3", str(script)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failed" not in result.stdout + result.stderr


def test_ending_without_finalize_is_not_failing(tmp_path: Path) -> None:
    """A rank that ends normally without finalize() is marked as left at exit."""
    script = tmp_path / "nofin.py"
    script.write_text(textwrap.dedent("""
        import time, torch, scaleout
        env = scaleout.init(timeout=60)
        d = env.create_distribution()
        d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait()
        if env.rank == 0:
            time.sleep(3.5)  # > 2 heartbeat limits after rank 1 has gone
        print("done", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "1.5"}
    result = subprocess.run([sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
                            env=env, capture_output=True, text=True, timeout=60)
    out = result.stdout + result.stderr
    assert "scaleout: rank" not in out and "PeerFailedError" not in out, out  # no watchdog report
    # (torch.distributed is torn down at exit: no gloo abort in interpreter teardown, see
    # test_watchdog_exits.py::test_a_rank_that_returns_without_finalize_is_torn_down_at_exit)
    assert result.returncode == 0, out


def test_wait_event_fails_fast_once_a_peer_failed() -> None:
    """The helper for wait loops outside Request (the scheduler's Job.wait)."""
    import threading

    from scaleout.core import peer_waits, watchdog
    from scaleout.core.errors import PeerFailedError

    class Found:
        period = 0.1

        def failure(self) -> watchdog.PeerFailure:
            return watchdog.PeerFailure(rank=2, reason="process exited", detected_by=1,
                                        silent_for=1.0)

        blocked = failure  # (what a waiting rank asks)

        def settle(self) -> None:
            pass

    event = threading.Event()
    assert peer_waits.wait_event(event, 0.3, 0, "lane 0", "gradient comm") is False
    watchdog._active.append(Found())  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        with pytest.raises(PeerFailedError, match="rank 0: gradient comm on group lane 0 cannot "
                                                  "complete: rank 2 failed: process exited") as info:
            peer_waits.wait_event(event, 30, 0, "lane 0", "gradient comm")
        assert info.value.failed_rank == 2 and time.monotonic() - started < 1.0
    finally:
        watchdog._active.clear()
        watchdog._exit_state["raised"] = False
