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

SRC = str(Path(__file__).parents[1] / "src")

# Trains 10 steps (2 ranks, momentum, per-rank random data), checkpoints every 3 steps and
# resumes from the checkpoint when there is one. On attempt 0 only, rank 1 kills itself
# (SIGKILL) before step KILL_AT; the digest of the final weights is printed by every rank.
TRAIN = """
    import hashlib, os, signal, sys, torch
    from torch import nn
    import scaleout
    from scaleout import checkpoint
    from scaleout.pytorch import DataParallel, DistributedOptimizer

    path, steps, kill_at = sys.argv[1], 10, int(sys.argv[2])
    env = scaleout.init(timeout=30)
    attempt = int(os.environ["SCALEOUT_RESTART_COUNT"])
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = DataParallel(net, env.create_distribution())
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), model)
    step = checkpoint.load(path, model, opt)[0] if os.path.islink(path) else 0
    print(f"attempt {attempt} starts at step {step}")
    while step < steps:
        if step == kill_at and attempt == 0 and env.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(torch.randn(8, 16) + env.rank).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 3 == 0:
            checkpoint.save(path, model, opt, step=step)
    model.synchronize()
    data = b"".join(p.detach().numpy().tobytes() for p in net.parameters())
    print(f"final step={step} weights={hashlib.sha256(data).hexdigest()}")
    model.close()
    env.finalize()
    sys.stdout.flush()
    os._exit(0)  # see _TEARDOWN in test_launcher.py
"""


def scaleout_run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "scaleout", "run", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def digests(stdout: str) -> set[str]:
    return set(re.findall(r"final step=10 weights=([0-9a-f]{64})", stdout))


def test_killed_rank_restarts_and_ends_bit_identical(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    plain = scaleout_run("-n", "2", str(script), str(tmp_path / "plain"), "-1")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    started = time.monotonic()
    killed = scaleout_run("-n", "2", "--max-restarts", "2", str(script),
                          str(tmp_path / "killed"), "7")
    took = time.monotonic() - started
    assert killed.returncode == 0, killed.stdout + killed.stderr
    assert "rank 1 failed first, with signal SIGKILL" in killed.stdout
    assert "restart 1 of 2: starting every rank again" in killed.stdout
    assert "[rank 0] attempt 1 starts at step 6" in killed.stdout
    assert ("every rank finished after 1 restart (attempt 0: rank 1 failed first, with "
            "signal SIGKILL)") in killed.stdout
    assert len(digests(plain.stdout)) == 1
    assert digests(killed.stdout) == digests(plain.stdout), (plain.stdout, killed.stdout)
    assert took < 60


FAILING = """
    import os, sys
    print("attempt", os.environ["SCALEOUT_RESTART_COUNT"], "of",
          os.environ["SCALEOUT_MAX_RESTARTS"], "state", os.path.isdir(os.environ["SCALEOUT_STATE_DIR"]))
    if os.environ["RANK"] == "1":
        sys.exit(3)
    import time; time.sleep(60)
"""


def test_spent_budget_fails_naming_the_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAILING))
    started = time.monotonic()
    result = scaleout_run("-n", "2", "--max-restarts", "2", str(script), timeout=60)
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
