"""Faults inside ``scaleout.checkpoint``: a rank that dies or freezes in the middle of a save is
named on the survivor (``PeerFailedError``), within the watchdog's period, not after the
collective timeout with a raw gloo error naming nobody (before: ``RuntimeError: ... Read error
... Connection reset by peer`` at once for a kill, ``Timed out waiting 30000ms for send
operation`` after the whole timeout for a stop)."""

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

#: a survivor's report: ``FOUND <rank> <seconds> <exception type> | <message>``
FOUND = re.compile(r"\[rank (\d+)\] FOUND ([\d.]+) (\w+) \| (.*)")

#: the preamble of every job: the launcher's settle period (5 s) is enough to report
PREAMBLE = """
    import os, signal, sys, time, torch, scaleout
    torch.set_num_threads(1)

    def die(how):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if how == "exit":
            os._exit(7)
        if how == "sleep":
            time.sleep(600)
        raise AssertionError(how)

    def report(started, err):
        print(f"FOUND {time.monotonic() - started:.2f} {type(err).__name__} | "
              + str(err).replace(chr(10), " "), flush=True)
        sys.exit(1)
"""


def run_job(tmp_path: Path, body: str, *args: str, nprocs: int = 2, timeout: float = 90.0,
            **env: str) -> tuple[subprocess.CompletedProcess[str], dict[int, tuple[float, str, str]]]:
    """Run PREAMBLE + ``body`` (with ``args``) under ``scaleout run``; the result and what
    each survivor reported: rank -> (seconds, exception type, message)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(PREAMBLE) + textwrap.dedent(body))
    environ = {**os.environ, "PYTHONPATH": SRC, "SCALEOUT_HEARTBEAT": "10", **env}
    # a stopped rank never exits: the launcher ends it after its settle and grace periods,
    # shortened here (the survivors have reported by then)
    run = run_command(settle=2.0, grace=1.0) if env.get("HOW") == "stop" else \
        [sys.executable, "-m", "scaleout", "run"]
    done = subprocess.run([*run, "-n", str(nprocs), str(script), *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)
    found = {int(m[1]): (float(m[2]), m[3], m[4]) for m in FOUND.finditer(done.stdout)}
    return done, found


SAVE = """
    from scaleout import checkpoint
    import scaleout.checkpoint as ck
    env = scaleout.init(timeout=30)  # far longer than the detection
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = sys.argv[1]
    checkpoint.save(folder + "/ck", model, opt, step=1)  # a good one first
    write = ck.write_atomic
    def write_or_die(*args):
        if env.rank == 1:
            die(os.environ["HOW"])
        return write(*args)
    ck.write_atomic = write_or_die
    started = time.monotonic()
    try:
        checkpoint.save(folder + "/ck", model, opt, step=2)
    except Exception as err:
        report(started, err)
    env.finalize()
"""


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_failing_in_a_save_is_named(tmp_path: Path, how: str) -> None:
    start = time.monotonic()
    done, found = run_job(tmp_path, SAVE, str(tmp_path), HOW=how)
    assert done.returncode != 0
    assert 0 in found, done.stdout[-3000:] + done.stderr[-2000:]
    seconds, kind, message = found[0]
    assert kind == "PeerFailedError", message
    assert "rank 1 failed" in message and "checkpoint" in message, message
    assert seconds < 10, message  # the watchdog's period, not the 30 s timeout
    assert time.monotonic() - start < 60
