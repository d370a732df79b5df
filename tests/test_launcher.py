"""The launcher through the real command: output tagged by rank, fail-fast on a failing rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scaleout.launch.launcher import LaunchConfig, command_for


def scaleout_run(*args: str, timeout: float = 60,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "scaleout", "run", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


# _TEARDOWN: these scripts leave the interpreter with os._exit(0) once finalize() returned.
# What the tests check (launch, tagging, rendezvous, the allreduce) is done by then, but
# torch 2.13's gloo can still abort in interpreter teardown after destroy_process_group
# ("terminate called without an active exception"): 1 of 25 two-node runs on a loaded
# 2-core machine, and once in a full run of this suite. torch reports the same abort at
# exit (pytorch/pytorch#190489; #179291, an atexit fix, was abandoned). It is tracked in the
# stop notes as scaleout's open problem; it must not make these tests fail at random.


def test_ranks_run_and_are_tagged(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, scaleout
        env = scaleout.init(timeout=30)
        d = env.create_distribution()
        total = d.allreduce(torch.ones(1) * (env.rank + 1), group=scaleout.GroupType.DATA).wait()
        print(f"r={env.rank} w={env.world_size} total={total.item():g} arg={sys.argv[1]}")
        env.finalize()
        sys.stdout.flush()
        os._exit(0)  # see _TEARDOWN
    """))
    result = scaleout_run("-n", "3", str(script), "hello")
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(3):
        assert f"[rank {rank}] r={rank} w=3 total=6 arg=hello" in result.stdout


def test_failing_rank_stops_the_others_fast(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("rank one fails on purpose")
        time.sleep(120)
    """))
    started = time.monotonic()
    result = scaleout_run("-n", "3", str(script))
    assert time.monotonic() - started < 30
    assert result.returncode == 1
    assert "scaleout run: rank 1 failed first, with exit code 1" in result.stdout
    assert "ValueError: rank one fails on purpose" in result.stdout


def test_a_launch_in_a_thread_stops_when_told(tmp_path: Path) -> None:
    """``launch(stop=event)``: the way to stop a launch that runs outside the main thread
    (no signal handler there), as bench train's warm ranks do; ranks stopped, 128 + SIGTERM."""
    import io
    import signal
    import threading

    from scaleout.launch.launcher import launch

    script = tmp_path / "sleepy.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    stop, out, codes = threading.Event(), io.StringIO(), []
    worker = threading.Thread(target=lambda: codes.append(
        launch([str(script)], LaunchConfig(nprocs=2), out=out, stop=stop)))
    worker.start()
    deadline = time.monotonic() + 30
    while out.getvalue().count("up") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    stop.set()
    worker.join(30)
    assert not worker.is_alive() and codes == [128 + signal.SIGTERM], out.getvalue()
    assert time.monotonic() - started < 10
    assert "scaleout run: got SIGTERM; stopped every rank" in out.getvalue()


def test_usage_errors(tmp_path: Path) -> None:
    result = scaleout_run("-n", "0", "x.py")
    assert result.returncode == 2 and "nprocs must be an int >= 1" in result.stderr
    result = scaleout_run("-n", "2", "--nnodes", "2", "x.py")
    assert result.returncode == 2 and "needs --master-port" in result.stderr
    with pytest.raises(ValueError, match="nothing to run"):
        command_for([])
    for target in (["-m"], ["-m", "-x"]):  # (was Python's own usage error on every rank)
        with pytest.raises(ValueError, match="-m needs a module name"):
            command_for(target)
    with pytest.raises(ValueError, match="node_rank must be in"):
        LaunchConfig(nprocs=1, nnodes=2, node_rank=2, master_port=1)
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    src = str(Path(__file__).parents[1] / "src")
    runs = [(message, subprocess.Popen(  # (at once: each imports torch to check its setting)
        [sys.executable, "-m", "scaleout", "run", "-n", "2", str(script)],
        env={**os.environ, "PYTHONPATH": src, name: value}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)) for name, value, message in (
            ("SCALEOUT_HEARTBEAT", "abc", "SCALEOUT_HEARTBEAT must be seconds"),
            ("SCALEOUT_CHECK", "maybe", "SCALEOUT_CHECK) must be one of"),
            ("SCALEOUT_BACKEND", "foo", "unknown backend 'foo' (SCALEOUT_BACKEND)"))]
    try:
        for message, run in runs:
            stdout, stderr = run.communicate(timeout=60)  # (was a traceback per rank)
            assert run.returncode == 2 and message in stderr, stderr
            assert "Traceback" not in stderr and "ran" not in stdout
    finally:
        for _, run in runs:
            run.kill()
    result = scaleout_run("-n", "1", str(script), env={"SCALEOUT_STATE_DIR": "/proc/no/such"})
    assert result.returncode == 2 and result.stderr.startswith(
        "scaleout run: error: SCALEOUT_STATE_DIR = '/proc/no/such' cannot be used"), result.stderr
    # an abbreviation was accepted by the parser but its value taken for the script
    # ("argument -n/--nproc-per-node: expected one argument")
    result = scaleout_run("--nproc", "2", str(script))
    assert result.returncode == 2 and "unrecognized arguments: --nproc" in result.stderr


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux's taskset")
def test_threads_per_rank_follow_the_cpus_the_launch_may_use(tmp_path: Path) -> None:
    # os.cpu_count() gave the whole machine's count under a cpuset or taskset
    script = tmp_path / "threads.py"
    script.write_text("import os\nprint('threads', os.environ['OMP_NUM_THREADS'])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "scaleout", "run",
                             "-n", "1", str(script)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "[rank 0] threads 1" in result.stdout, result.stdout


NODES = """
    import os, sys, torch, scaleout
    env = scaleout.init(timeout=30)
    d = env.create_distribution()
    total = d.allreduce(torch.ones(1), group=scaleout.GroupType.DATA).wait()
    print(f"rank={env.rank} local={env.local_rank} node={os.environ['GROUP_RANK']} "
          f"total={total.item():g}")
    env.finalize()
    sys.stdout.flush()
    os._exit(0)  # see _TEARDOWN
"""


@pytest.mark.parametrize("late", [0.0, 3.0])
def test_two_nodes_rendezvous(tmp_path: Path, late: float) -> None:
    """Two launchers (as on two nodes) with --nnodes/--node-rank form one job, also when
    node 1 starts ``late`` seconds after node 0; node 0 prints node 1's command, not the
    secret."""
    from scaleout.launch.launcher import free_port

    script = tmp_path / "nodes.py"
    script.write_text(textwrap.dedent(NODES))
    port = str(free_port())
    secret = "the same secret on every node"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "SCALEOUT_JOB_TOKEN": secret}
    nodes = []
    for node in range(2):
        if node == 1:
            time.sleep(late)
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "scaleout", "run", "-n", "1", "--nnodes", "2", "--node-rank",
             str(node), "--master-port", port, str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=60)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    assert "[rank 0] rank=0 local=0 node=0 total=2" in outputs[0]
    assert "[rank 1] rank=1 local=0 node=1 total=2" in outputs[1]
    command = (f"scaleout run -n 1 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 "
               f"--master-port {port} {script}")
    assert f"\n  {command}\n" in outputs[0]
    assert "with SCALEOUT_JOB_TOKEN exported to the same secret" in outputs[0]
    assert secret not in outputs[0] and "node 0 of 2" not in outputs[1]


def test_split_argv_keeps_target_options() -> None:
    from scaleout.cli.run import split_argv

    assert split_argv(["-n", "2", "-m", "pkg.mod", "--flag", "1"]) == (
        ["-n", "2"], ["-m", "pkg.mod", "--flag", "1"])
    assert split_argv(["--testbed", "tb", "train.py", "-n", "5"]) == (
        ["--testbed", "tb"], ["train.py", "-n", "5"])
    assert split_argv(["-n", "2", "--", "-x"]) == (["-n", "2"], ["--", "-x"])


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """torchrun --nnodes 2 on loopback (two agents, as on two nodes, node 1 a second late)
    starts a scaleout job: ranks, nodes and the allreduce as with ``scaleout run``."""
    from scaleout.launch.launcher import free_port

    script = tmp_path / "nodes.py"
    script.write_text(textwrap.dedent(NODES))
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
           "SCALEOUT_JOB_TOKEN": "the same secret on every node"}
    nodes = []
    for node in range(2):
        if node == 1:
            time.sleep(1.0)
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
             str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
             port, str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=90)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    assert "rank=0 local=0 node=0 total=2" in outputs[0], outputs
    assert "rank=1 local=0 node=1 total=2" in outputs[1], outputs
    assert "without the job token" not in outputs[0], outputs  # the agents' entries are theirs
