"""Launcher and launch-convention defects found in a bug hunt: each test failed before its fix.

- a Slurm node list with text after a range (``node[1-4]-ib``) put the rendezvous on
  ``node1``, a host of the wrong network or none;
- ranks given different world sizes (nodes started with different ``-n`` / ``--nnodes``)
  were admitted and then timed out, on rank 0 after several times the timeout, blaming the
  job token; a rank past rank 0's world was never refused at all;
- ``scaleout run --master-addr ""`` (an unset shell variable) started every rank, each
  failing in a traceback, rc 1;
- a ``TORCHELASTIC_USE_AGENT_STORE=True`` inherited by ``scaleout run`` made every rank a
  client of a store nobody served: the job failed after the rendezvous timeout;
- under torchrun's agent store a restarted rank could read the last attempt's entries;
- a stop signal that came after a rank had failed (while the others settled) hid it: the
  report said only ``got SIGTERM; stopped every rank``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from scaleout.cli.main import main
from scaleout.launch.environment import detect_launch, first_host
from scaleout.launch.launcher import LaunchConfig, free_port, launch

SRC = str(Path(__file__).parents[1] / "src")


@pytest.mark.parametrize("nodelist,host", [
    ("node[1-4]-ib", "node1-ib"), ("rack[1-2]-node[01-04],x", "rack1-node01"),
    ("gpu-a[009-010],gpu-b1", "gpu-a009"), ("a[3,1]b,c[1-2]", "a3b"), ("cn[07-08,11]", "cn07"),
])
def test_first_host_keeps_what_follows_a_range(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host
    info = detect_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODELIST": nodelist})
    assert info.master_addr == host


@pytest.mark.parametrize("nodelist", ["n[1-2", "n]1", "n[1-2]x]"])
def test_first_host_refuses_brackets_that_do_not_pair(nodelist: str) -> None:
    with pytest.raises(ValueError, match="brackets must pair up"):
        first_host(nodelist)


JOIN = """
    import sys, time
    from scaleout.launch.environment import LaunchInfo
    from scaleout.launch.rendezvous import rendezvous
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    info = LaunchInfo(rank=rank, world_size=world, local_rank=0, master_addr="127.0.0.1",
                      master_port={port}, source="test")
    started = time.monotonic()
    try:
        rendezvous(info, "tok", timeout=20)
    except Exception as err:
        print(f"{{type(err).__name__}} after {{time.monotonic() - started:.1f}} s: {{err}}")
        sys.exit(1)
    print("admitted")
"""


@pytest.mark.parametrize("other", [(1, 3), (2, 3)])  # (rank, world): within rank 0's, past it
def test_ranks_of_another_world_size_are_refused_at_once(other: tuple[int, int]) -> None:
    """Rank 0 counts 2 ranks; the other counts 3, as rank 1 (which rank 0 waits for) or as
    rank 2 (which it does not). Both are refused within seconds, naming both sizes."""
    port = free_port()
    code = textwrap.dedent(JOIN.format(port=port))
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(world)], env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank, world in ((0, 2), other)]
    try:
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [1, 1], outputs
    said = f"rank {other[0]} joined with a world size of 3, rank 0 with 2"
    assert "ScaleoutError" in outputs[0] and f"rank 0 refused the job: {said}" in outputs[0]
    assert said in outputs[1], outputs[1]
    for output in outputs:  # (the timeout is 20 s)
        assert float(output.split(" after ")[1].split(" s")[0]) < 10, output


def test_a_master_addr_that_names_no_host_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    for addr in ("", " ", "node 0"):
        with pytest.raises(ValueError, match="master_addr must be a host name or address"):
            LaunchConfig(nprocs=2, master_addr=addr)
    assert main(["run", "-n", "2", "--master-addr", "", "x.py"]) == 2
    assert "scaleout run: error: master_addr must be a host name or address, got ''" in \
        capsys.readouterr().err


def test_an_inherited_agent_store_setting_does_not_reach_the_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun tells its ranks that its agent serves the store; ``scaleout run`` serves
    none (rank 0 does), so a value inherited from a torchrun environment must not pass."""
    script = tmp_path / "show.py"
    script.write_text("import os; print('agent=' + os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    out = io.StringIO()
    started = time.monotonic()
    assert launch([str(script)], LaunchConfig(nprocs=1), out=out) == 0, out.getvalue()
    assert "[rank 0] agent=False" in out.getvalue()
    assert time.monotonic() - started < 30


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "MASTER_ADDR", "MASTER_PORT")


def test_ranks_get_every_variable_torchrun_sets(tmp_path: Path) -> None:
    """A script written for torchrun may read any of its variables (before stop 51
    ``GROUP_WORLD_SIZE``, ``ROLE_*`` and ``TORCHELASTIC_RUN_ID`` were missing: a KeyError)."""
    script = tmp_path / "show.py"
    script.write_text("import os\nprint(' '.join(f'{k}={os.environ[k]}' for k in "
                      f"{TORCHRUN_VARS!r}))\n")
    out = io.StringIO()
    assert launch([str(script)], LaunchConfig(nprocs=2), out=out) == 0, out.getvalue()
    seen = {line.split("] ", 1)[0] + "]": dict(pair.split("=", 1) for pair in
                                                line.split("] ", 1)[1].split())
            for line in out.getvalue().splitlines() if line.startswith("[rank")}
    assert sorted(seen) == ["[rank 0]", "[rank 1]"], out.getvalue()
    for rank in (0, 1):
        env = seen[f"[rank {rank}]"]
        assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["GROUP_WORLD_SIZE"],
                env["ROLE_NAME"]) == (str(rank), "2", "1", "default"), env
    assert seen["[rank 0]"]["TORCHELASTIC_RUN_ID"] == seen["[rank 1]"]["TORCHELASTIC_RUN_ID"]


AGENT_RANK = """
    import os, scaleout
    env = scaleout.init(timeout=20)
    print("joined", env.rank, flush=True)
    env.finalize()
    os._exit(0)
"""


def test_a_restart_under_torchruns_agent_store_ignores_the_last_attempts_entries(
        tmp_path: Path) -> None:
    """torchrun's agent serves one store for every attempt of a job. A rank of attempt 1
    that came before rank 0 read attempt 0's salt and found its rank already claimed
    (``another process already joined this job as rank 1``: 2 of 6 restarts under
    ``torchrun --max-restarts 1`` failed so). Here rank 1 always comes first."""
    import torch.distributed as tdist
    from datetime import timedelta

    port = free_port()
    agent = tdist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(AGENT_RANK))

    def start(rank: int, attempt: int) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": SRC, "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "SCALEOUT_JOB_TOKEN": "tok",
               "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        return subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    procs: list[subprocess.Popen[str]] = []
    try:
        for attempt in (0, 1):
            procs = [start(1, attempt)]
            time.sleep(3.0)  # (rank 1 imports torch and reaches the store first)
            procs.insert(0, start(0, attempt))
            outputs = [proc.communicate(timeout=60)[0] for proc in procs]
            assert [proc.returncode for proc in procs] == [0, 0], (attempt, outputs)
            assert all(f"joined {rank}" in out for rank, out in enumerate(outputs)), outputs
    finally:
        for proc in procs:
            proc.kill()
    del agent


FAILED_THEN_STOPPED = """
    import os, signal, sys, time
    if os.environ["RANK"] == "1":
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1], "w").close()
    time.sleep(60)
"""


def test_a_stop_after_a_failure_still_names_the_failed_rank(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(FAILED_THEN_STOPPED))
    ready = tmp_path / "ready"
    out, stop, codes = io.StringIO(), threading.Event(), []
    config = LaunchConfig(nprocs=2, settle=30.0, grace=0.5)  # (rank 0 outlives the failure)
    thread = threading.Thread(target=lambda: codes.append(
        launch([str(script), str(ready)], config, out=out, stop=stop)))
    thread.start()
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # (rank 1 has exited by now)
    stop.set()
    thread.join(timeout=30)
    assert codes == [143], out.getvalue()
    assert ("scaleout run: got SIGTERM; stopped every rank (rank 1 had failed before it, "
            "with exit code 3)") in out.getvalue()
