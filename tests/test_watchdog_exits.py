"""How ranks end: a rank that exits without finalize() while its peers communicate, the store's
host (rank 0) dying, a peer failing or diverging in finalize(), the rendezvous hint, and the
exit after a CommunicationTimeout. Ranks are started by hand with torchrun's variables (no
``scaleout run``, whose exit notes would name some of these failures by themselves)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness import free_port

SRC = str(Path(__file__).parents[1] / "src")
_LAUNCHER_VARS = ("SCALEOUT_LAUNCHER_PID", "SCALEOUT_LAUNCHER_ID", "SCALEOUT_REPORT_DIR")


def launch(tmp_path: Path, body: str, nprocs: int, timeout: float = 60.0,
           **extra: str) -> list[tuple[int, str]]:
    """Run ``body`` as ``nprocs`` ranks (torchrun's variables); (exit code, output) by rank.
    The ranks' pids are written to ``$PIDS_FILE`` once all are started (see OTHERS_GONE)."""
    script = tmp_path / "job.py"
    script.write_text(OTHERS_GONE + textwrap.dedent(body))
    pids = tmp_path / "pids"
    port, token = free_port(), secrets.token_hex(16)
    procs, logs = [], []
    for rank in range(nprocs):
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env.update(PYTHONPATH=SRC, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   SCALEOUT_JOB_TOKEN=token, **{"SCALEOUT_HEARTBEAT": "10",
                                                 "PIDS_FILE": str(pids), **extra})
        logs.append(tmp_path / f"rank{rank}.txt")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-u", str(script)], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    (tmp_path / "pids.tmp").write_text(" ".join(str(proc.pid) for proc in procs))
    (tmp_path / "pids.tmp").replace(pids)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(proc.returncode, log.read_text()) for proc, log in zip(procs, logs)]


#: Defines ``others_gone(cap)`` in every body: it returns once every other rank's process has
#: ended (launch() writes their pids to ``$PIDS_FILE``; a zombie has ended), or after ``cap``
#: seconds. A rank that must outlive the others' failures waits so, not for a fixed time.
OTHERS_GONE = """
def others_gone(cap):
    import os, time
    deadline, path = time.monotonic() + cap, os.environ["PIDS_FILE"]
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    others = [int(p) for p in open(path).read().split() if int(p) != os.getpid()]
    while any(running(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def detected(output: str) -> tuple[int, float, str] | None:
    """(failed rank named, seconds from the last good step, message) of a DETECTED line."""
    found = re.search(r"DETECTED failed_rank=(\d+) after=([\d.]+) \| (.*)", output)
    return (int(found[1]), float(found[2]), found[3]) if found else None


LOOP = """
    import os, signal, sys, time, torch, scaleout
    from scaleout.core.errors import PeerFailedError
    if os.environ.get("FAKE_MACHINES"):  # as if every rank ran on its own host: no /proc view
        import scaleout.core.watchdog as wd, scaleout.launch.rendezvous as rv
        wd.machine = rv.machine = lambda: "host-" + os.environ["RANK"]
    env = scaleout.init(timeout=60)  # far longer than the heartbeat limit (10 s)
    d = env.create_distribution()
    victim, how = int(os.environ["VICTIM"]), os.environ["HOW"]
    last = time.monotonic()
    for step in range(100000):
        if env.rank == victim and step == 5:
            if how == "return":
                break  # the script ends, without finalize()
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            sys.exit({"exit0": 0, "exit3": 3}[how])
        try:
            d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
        except PeerFailedError as err:
            print(f"DETECTED failed_rank={err.failed_rank} after={time.monotonic() - last:.2f} "
                  f"| {err}", flush=True)
            sys.exit(1)
        last = time.monotonic()
        time.sleep(0.01)
"""


@pytest.mark.parametrize("nprocs,how", [(2, "exit0"), (2, "exit3"), (2, "return"),
                                        (3, "exit0")])
def test_a_rank_that_exits_without_finalize_is_named(tmp_path: Path, nprocs: int,
                                                     how: str) -> None:
    """Not a normal leave: the survivors, blocked on it, name it within a couple of seconds
    (before: a gloo "Connection closed by peer" naming nobody, after the heartbeat limit)."""
    ranks = launch(tmp_path, LOOP, nprocs, VICTIM="1", HOW=how)
    assert ranks[1][0] == {"exit0": 0, "exit3": 3, "return": 0}[how], ranks[1][1]
    for rank in (0, 2)[:nprocs - 1]:
        code, out = ranks[rank]
        found = detected(out)
        assert found is not None and code == 1, out
        failed, after, message = found
        assert failed == 1 and after < 4.0, out
        assert "rank 1 failed: exited without finalize() while the others were still " \
               "communicating" in message, out


@pytest.mark.parametrize("fake_machines", [False, True])
def test_the_store_hosts_death_names_rank_0(tmp_path: Path, fake_machines: bool) -> None:
    """Rank 0 (which serves the store) killed: ranks 1 and 2 name it at once, from /proc on
    this machine, from the broken store connection without a /proc view (before: a c10d
    "sendBytes failed ... Broken pipe" and, after the heartbeat limit, a silent store)."""
    extra = {"FAKE_MACHINES": "1"} if fake_machines else {}
    ranks = launch(tmp_path, LOOP, 3, VICTIM="0", HOW="kill", **extra)
    assert ranks[0][0] == -9
    for code, out in ranks[1:]:
        found = detected(out)
        assert found is not None and code == 1, out
        failed, after, message = found
        assert failed == 0 and after < 4.0, out
        assert "rank 0 (host of the rendezvous store) is unreachable: " in message, out
        assert ("process exited" in message) != fake_machines, out


FINALIZE = """
    import os, signal, sys, time, torch, scaleout
    from scaleout.core.errors import PeerFailedError
    env = scaleout.init(timeout=float(os.environ.get("TMO", "10")))
    d = env.create_distribution()
    for _ in range(3):
        d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
    how = os.environ["HOW"]
    if env.rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit0":
            sys.exit(0)
        # one more call than rank 0: one it made before, or a new one
        d.allreduce(torch.ones(4 if how == "extra_known" else 5),
                    group=scaleout.GroupType.DATA).wait()
    started = time.monotonic()
    try:
        env.finalize()
    except PeerFailedError as err:
        print(f"DETECTED failed_rank={err.failed_rank} after={time.monotonic() - started:.2f} "
              f"| {err}", flush=True)
        sys.exit(1)
    print("finalized", flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "exit0"])
def test_a_peer_failing_in_finalize_is_named(tmp_path: Path, how: str) -> None:
    """finalize()'s barrier is watched (before: a raw gloo RuntimeError naming nobody)."""
    (code, out), (victim_code, _) = launch(tmp_path, FINALIZE, 2, HOW=how)
    assert victim_code == (-9 if how == "kill" else 0)
    found = detected(out)
    assert found is not None and code == 1, out
    failed, after, message = found
    assert failed == 1 and after < 4.0, out
    assert message.startswith("rank 0: finalize") and "on group global[0, 1]" in message, out


@pytest.mark.parametrize("check,how", [("1", "extra_known"), ("", "extra_new")])
def test_finalize_meeting_another_collective_is_a_mismatch(tmp_path: Path, check: str,
                                                           how: str) -> None:
    """Rank 1 makes one call more than rank 0, which is in finalize(): a ValueError naming
    both calls on both ranks, with SCALEOUT_CHECK=1, and by default ("first") when that call
    is new (before: both timed out, and rank 1 could abort)."""
    # (heartbeat limit 2 s, not 10: rank 0, the store's host, lingers 1.3 s at exit, not 2.5)
    ranks = launch(tmp_path, FINALIZE, 2, HOW=how, SCALEOUT_CHECK=check, SCALEOUT_HEARTBEAT="2")
    shape = "(4,)" if how == "extra_known" else "(5,)"
    listing = f"rank 0: finalize(); rank 1: allreduce(float32, shape {shape}, SUM)"
    for rank, (code, out) in enumerate(ranks):
        assert code == 1, out
        where = "finalize on group global[0, 1]" if rank == 0 else "allreduce on group data[0, 1]"
        assert f"ValueError: rank {rank}: {where}: the ranks called different collectives" \
               in out, out
        assert listing in out, out


def test_finalize_meeting_a_repeated_call_is_named_within_seconds(tmp_path: Path) -> None:
    """By default ("first") a call made before is not checked again: rank 1's extra call
    waits for rank 0, which is in finalize() with nothing in progress and will never start
    it. Since stop 51 rank 1 declares that from rank 0's heartbeat (core/diverged.py) and both
    raise PeerFailedError naming rank 1 within seconds, status 1, no abort; before, both sat
    out the timeout (CommunicationTimeout naming the other from its heartbeat; before the
    quick exit after one, 3 of 6 runs aborted: SIGABRT)."""
    ranks = launch(tmp_path, FINALIZE, 2, HOW="extra_known", TMO="40")
    why = ("rank 1 waits in allreduce on group data[0, 1], its collective 5 there, which rank 0 "
           "will never start: it is in finalize() (rank 0 after 4 on this group)")
    (code0, out0), (code1, out1) = ranks
    assert code0 == 1 and "DETECTED failed_rank=1" in out0 and why in out0, out0
    assert float(out0.split("after=")[1].split()[0]) < 20, out0
    assert code1 == 1 and "PeerFailedError: rank 1: allreduce on group data[0, 1] cannot " \
        f"complete: {why}" in out1, out1
    assert "terminate called" not in out0 + out1, (out0, out1)


def test_a_rendezvous_timeout_asks_about_the_token(tmp_path: Path) -> None:
    """torch says "wait timeout": the hint about the token is there (it looked for "Timeout")."""
    body = """
        import scaleout
        from scaleout.core.errors import ScaleoutError
        try:
            scaleout.init(timeout=1)  # rank 0 of 2, alone: rank 1 never joins
        except ScaleoutError as err:
            print("ERROR", err, flush=True)
    """
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(PYTHONPATH=SRC, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=60)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ERROR")), "")
    assert "timeout" in line.lower(), done.stdout + done.stderr
    assert line.endswith("(is SCALEOUT_JOB_TOKEN the same on every rank?)"), line


def test_a_rank_leaves_at_once_after_an_uncaught_timeout(tmp_path: Path) -> None:
    """After an uncaught CommunicationTimeout (its gloo work still pending) the rank prints
    the error, then leaves with status 1 without tearing torch.distributed down, where
    gloo could abort ("terminate called without an active exception", SIGABRT): an exit
    handler registered before init() (it would run after scaleout's) does not run."""
    body = """
        import atexit, os, sys, time, torch, scaleout
        atexit.register(lambda: print("interpreter teardown ran", flush=True))
        env = scaleout.init(timeout=30)
        d = env.create_distribution()
        d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait()
        if env.rank == 1:
            others_gone(30)  # alive (its heartbeat beats), in no collective, until rank 0 left
            os._exit(0)
        d.allreduce(torch.ones(2), group=scaleout.GroupType.DATA).wait(1.5)
    """
    # (heartbeat limit 2 s, still above the 1.5 s wait: rank 0 lingers 1.3 s at exit, not 2.5)
    (code, out), (other, _) = launch(tmp_path, body, 2, SCALEOUT_HEARTBEAT="2")
    assert code == 1 and other == 0, out
    assert "CommunicationTimeout: rank 0: allreduce on group data[0, 1] did not complete " \
           "within 1.5 s" in out, out
    assert "interpreter teardown ran" not in out and "terminate called" not in out, out


def test_a_rank_that_returns_without_finalize_is_torn_down_at_exit(tmp_path: Path) -> None:
    """torch.distributed is destroyed before the interpreter finalises: gloo's worker threads
    would otherwise free a finished work's tensors after Python has stopped running threads,
    and the process aborts at random ("terminate called without an active exception"; 2 of
    20 three-rank runs of this script before). An exit handler registered before scaleout's
    import runs after scaleout's own."""
    body = """
        import atexit, torch.distributed as tdist
        atexit.register(lambda: print("at the end, initialised:", tdist.is_initialized(),
                                      flush=True))
        import torch, scaleout
        env = scaleout.init(timeout=30)
        d = env.create_distribution()
        for _ in range(3):
            d.allreduce(torch.ones(1000), group=scaleout.GroupType.DATA).wait()
    """
    for code, out in launch(tmp_path, body, 3):
        assert code == 0 and "at the end, initialised: False" in out, out


def test_a_ranks_last_heartbeat_says_it_left(tmp_path: Path) -> None:
    """Rank 1 returns without finalize() while rank 0 goes on alone (no collective); the
    ``left/1`` entry rank 1 writes at exit is lost (as if an outsider deleted it). Its last
    heartbeat says it left, so rank 0, seeing its process gone, names no failure (before:
    ``rank 1 failed: process exited``)."""
    body = """
        import os, time, torch, scaleout
        if os.environ["RANK"] == "1":  # its left/1 entry never reaches the store
            import scaleout.launch.rendezvous as rv
            real = rv.AuthStore.set
            rv.AuthStore.set = lambda self, key, value: (
                None if key.startswith("left/") else real(self, key, value))
        env = scaleout.init(timeout=30)
        d = env.create_distribution()
        d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA).wait()
        if env.rank == 0:  # its watchdog sees rank 1's process gone within a period (0.4 s)
            others_gone(30)
            time.sleep(1.0)
        print("done", flush=True)
    """
    for code, out in launch(tmp_path, body, 2, SCALEOUT_HEARTBEAT="2"):
        assert code == 0 and "done" in out and "failed" not in out, out


def test_a_teardown_at_exit_that_cannot_end_is_bounded(tmp_path: Path) -> None:
    """Rank 0 returns with a collective its peer never joins (checks off): the teardown at
    exit waits for it at most EXIT_TEARDOWN_S, then the rank leaves with status 1 and every
    thread's traceback, not after the collective timeout (60 s)."""
    body = """
        import time, torch, scaleout, scaleout.core.env as core_env
        core_env.EXIT_TEARDOWN_S = 1.0
        env = scaleout.init(timeout=60)
        d = env.create_distribution()
        if env.rank == 0:
            d.allreduce(torch.ones(4), group=scaleout.GroupType.DATA)  # never matched
        else:
            others_gone(30)  # alive, in no collective, until rank 0 left
    """
    (code, out), _ = launch(tmp_path, body, 2, SCALEOUT_CHECK="0", SCALEOUT_HEARTBEAT="2")
    assert code == 1 and "Timeout (0:00:01)!" in out and "_leave_at_exit" in out, out


def test_only_communication_errors_and_mismatches_take_the_quick_exit() -> None:
    from scaleout.core.errors import CommunicationTimeout
    from scaleout.core.failures import broken_by_communication as _broken

    timeout = CommunicationTimeout("t", rank=0, group="g", operation="allreduce")
    try:
        try:
            raise timeout
        except CommunicationTimeout as err:
            raise KeyError("wrapped") from err
    except KeyError as wrapped:
        assert _broken(wrapped)
    mismatch = ValueError("the ranks called different collectives")
    mismatch.collective_mismatch = True  # type: ignore[attr-defined]  # (as the check marks it)
    assert _broken(timeout) and _broken(mismatch)
    assert not _broken(ValueError("bad argument")) and not _broken(None)


def test_ranks_timed_out_by_a_busy_peer_name_it(tmp_path: Path) -> None:
    """Rank 1 alive but busy outside communication: ranks 0 and 2 time out (uncaught) and
    name it from its heartbeat's call counts (core/progress.py); rank 0, the store's host,
    keeps the store up a little on its way out, so rank 2 can still read them."""
    body = """
        import os, time, torch, scaleout
        env = scaleout.init(timeout=3)
        d = env.create_distribution()
        for _ in range(2):
            d.allreduce(torch.ones(2), group=scaleout.GroupType.GLOBAL).wait()
        if env.rank == 1:
            others_gone(30)  # alive (its heartbeat beats), in no collective, until 0 and 2 left
            os._exit(0)
        d.allreduce(torch.ones(2), group=scaleout.GroupType.GLOBAL).wait()
    """
    ranks = launch(tmp_path, body, 3)
    for rank in (0, 2):
        code, out = ranks[rank]
        assert code == 1, out
        assert f"CommunicationTimeout: rank {rank}: allreduce on group global[0, 1, 2] did not " \
               "complete within 3 s (rank 1 is alive but not at this call" in out, out
