"""Fork real ranks for a test: torchrun variables set, per-run timeout, rank-tagged failures.

Usage::

    def body(x):                      # module-level: runs in every rank
        env = scaleout.init(timeout=20)
        ...
        env.finalize()
        return value

    results = run_ranks(3, body, 42)   # [value of rank 0, rank 1, rank 2]
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["run_ranks", "free_port", "RankFailure", "cuda_available", "scaleout_run",
           "run_command", "others_done"]

#: The folder where each rank of a run_ranks job says it is done (``done.<rank>``).
DONE_DIR_VAR = "HARNESS_DONE_DIR"


class RankFailure(AssertionError):
    """One or more ranks failed or hung; the message holds each rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(conn: Any, rank: int, world_size: int, port: int, fn: Callable[..., Any],
           args: tuple[Any, ...], env: Mapping[str, str], timeout: float) -> None:
    # What the parent left for its garbage collector stays the parent's: a rank that
    # collected it would run finalizers of objects whose threads it does not have (a store
    # server left in a reference cycle by an earlier test: its destructor waits for them).
    gc.freeze()
    code = 0
    try:
        os.environ.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **env,
        })
        import torch

        torch.set_num_threads(1)
        # A hung rank prints where it hangs before the parent gives up on it.
        faulthandler.dump_traceback_later(max(timeout - 1.0, 1.0), exit=True)
        result = fn(*args)
        payload = pickle.dumps(("ok", result))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        payload = pickle.dumps(("error", traceback.format_exc()))
        code = 1
    try:  # (others_done)
        open(os.path.join(os.environ[DONE_DIR_VAR], f"done.{rank}"), "w").close()
    except (KeyError, OSError):
        pass
    try:
        conn.send_bytes(payload)
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


#: torch's own notices about the machine rather than the code: a CUDA build of torch on a
#: machine without a CUDA runtime (torch 2.11+cu130 on a CPU machine) says this when
#: inductor starts. Tests that assert "no warnings" leave these out.
TORCH_MACHINE_NOTICES = ("No CUDA runtime is found",)


def machine_notice(line: str) -> bool:
    """Whether ``line`` is one of :data:`TORCH_MACHINE_NOTICES`."""
    return any(notice in line for notice in TORCH_MACHINE_NOTICES)


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """Whether torch can use CUDA here, asked in a child process: asking in this one could
    initialise the CUDA driver, after which the ranks forked from it could not use CUDA."""
    import torch

    if not torch.backends.cuda.is_built():
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0


def _start_method() -> str:
    """``fork`` (about 20x cheaper than spawn here), unless this process has initialised
    CUDA, which a forked child cannot use; ``SCALEOUT_TEST_START`` overrides."""
    forced = os.environ.get("SCALEOUT_TEST_START")
    if forced:
        return forced
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def others_done(cap: float = 30.0) -> None:
    """In a rank of :func:`run_ranks`: wait until every other rank has returned or raised,
    at most ``cap`` seconds. For a rank that must stay alive outside communication (its
    heartbeat going, the store up if it hosts it) while the others' waits on it time out:
    rather than sleeping for longer than their timeout, whatever the machine's load."""
    folder, rank = os.environ[DONE_DIR_VAR], int(os.environ["RANK"])
    others = [os.path.join(folder, f"done.{r}") for r in range(int(os.environ["WORLD_SIZE"]))
              if r != rank]
    deadline = time.monotonic() + cap
    while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
        time.sleep(0.02)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0,
              env: Mapping[str, str] | None = None, start_method: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` forked ranks and return their results by rank.

    ``start_method="spawn"`` starts fresh interpreters instead (slower): for bodies that
    import much of torch lazily (torch.compile), which a fork can deadlock when another
    thread of this process held an import lock at that moment.

    Raises:
        RankFailure: a rank raised (its traceback, tagged with the rank, is in the message),
            died, or did not finish within ``timeout`` seconds (the others are then killed).
    """
    ctx = mp.get_context(start_method or _start_method())
    port = free_port()
    done = tempfile.mkdtemp(prefix="harness-done-")
    try:
        return _run(ctx, port, world_size, fn, args, {**(env or {}), DONE_DIR_VAR: done},
                    timeout)
    finally:
        shutil.rmtree(done, ignore_errors=True)


def _run(ctx: Any, port: int, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...],
         env: dict[str, str], timeout: float) -> list[Any]:
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child,
                           args=(child, rank, world_size, port, fn, args, env, timeout))
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        ready = mp.connection.wait([conns[r] for r in pending], timeout=0.2)
        for rank in list(pending):
            conn = conns[rank]
            if conn in ready:
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, value = "error", f"rank {rank} died (exit code {procs[rank].exitcode})"
                (results if status == "ok" else errors)[rank] = value
                pending.discard(rank)
        if errors and pending:  # give the others a moment to report, then stop them
            deadline = min(deadline, time.monotonic() + 5.0)
    for rank in pending:
        errors[rank] = f"rank {rank} did not finish within {timeout:g} s (see its stack above)"
    for proc in procs:
        proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if errors:
        text = "\n".join(f"----- rank {r} -----\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [results[r] for r in range(world_size)]


def require_testbed() -> None:
    """Skip unless this machine can host a testbed (root, ip, tc); under CI=true, fail."""
    import pytest

    from scaleout.testbed import TestbedUnavailable, check_capabilities

    try:
        check_capabilities()
    except TestbedUnavailable as err:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the testbed cannot run here: {err}")
        pytest.skip(str(err))


def scaleout_run(*args: str, timeout: float = 240.0,
                 returncode: int = 0) -> subprocess.CompletedProcess[str]:
    """``python -m scaleout run ARGS`` with this checkout's ``src`` first on the path, its
    output captured; an exit code other than ``returncode`` fails the test with the output's
    tail."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "scaleout", "run", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done


#: ``scaleout run`` as the command builds it, but for the launch's settle and grace periods:
#: after a failure the launcher waits ``settle`` seconds for the other ranks to end by
#: themselves, then ``grace`` between SIGTERM and SIGKILL. A rank that never ends by itself
#: (stopped, asleep, ignoring SIGTERM) makes a job wait out both (5 s and 3 s by default);
#: a test of something else need not.
_RUN_WITH_PERIODS = """
import dataclasses, sys
import scaleout.cli.run as run
from scaleout.cli.main import main
settle, grace, launch = float(sys.argv[1]), float(sys.argv[2]), run.launch
run.launch = lambda target, config, **kw: launch(
    target, dataclasses.replace(config, settle=settle, grace=grace), **kw)
sys.exit(main(["run", *sys.argv[3:]]))
"""


def run_command(settle: float, grace: float) -> list[str]:
    """argv of ``python -m scaleout run`` whose launch has the given settle and grace periods
    (seconds); run's own arguments and the script follow."""
    return [sys.executable, "-c", _RUN_WITH_PERIODS, str(settle), str(grace)]
