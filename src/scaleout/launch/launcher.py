"""Start N local ranks with the torchrun variables set; stop them all when one fails.

:func:`launch` is what ``scaleout run`` calls. Each rank's output lines are prefixed with
``[rank R]``. The launcher owns its ranks:

- when a rank exits non-zero, the others are stopped (SIGTERM to each rank's process group,
  SIGKILL after ``grace`` seconds) and the launcher returns the exit code of the rank that
  failed *first* (by time of exit: a rank that fails because a peer died is not blamed),
  after repeating the end of its output;
- SIGTERM, SIGHUP or SIGINT to the launcher stop every rank the same way and it returns
  128 + the signal number;
- a rank dies with the launcher (``kill -9`` included): see :mod:`scaleout.launch.lifeline`.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from scaleout.launch.lifeline import LAUNCHER_PID_VAR, REPORT_DIR_VAR, blamed, die_with_parent
from scaleout.launch.secret import TOKEN_VAR, new_token

__all__ = ["LaunchConfig", "RankWrapper", "launch", "free_port", "command_for"]

# Per local rank: (argv prefix, extra environment), e.g. to run inside a testbed host.
RankWrapper = Callable[[int], tuple[list[str], dict[str, str]]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command_for(target: Sequence[str]) -> list[str]:
    """The argv that runs ``target``: a ``.py`` script or ``-m module`` under this Python.

    Raises:
        ValueError: nothing to run, the script does not exist, or the command is not found.
    """
    target = list(target)
    if not target:
        raise ValueError("nothing to run: give a script (script.py [args]) or -m module [args]")
    if target[0] == "-m":
        return [sys.executable, "-u", *target]
    if target[0].endswith(".py"):
        if not os.path.isfile(target[0]):
            raise ValueError(f"no such script: {target[0]}")
        return [sys.executable, "-u", *target]
    if shutil.which(target[0]) is None:
        raise ValueError(f"no such command: {target[0]} (expected script.py, -m module or "
                         "an executable on PATH)")
    return target


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Where and how many ranks to start.

    Attributes:
        nprocs: ranks on this node.
        nnodes: nodes in the job (each runs ``scaleout run`` with its own ``node_rank``).
        node_rank: this node's index.
        master_addr: address of node 0 (the rendezvous).
        master_port: rendezvous port; ``None`` picks a free one (single node only).
        prefix_output: prefix every output line with ``[rank R]``.
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        env: extra environment for every rank.

    The ranks get the job secret ``SCALEOUT_JOB_TOKEN`` (from ``env`` or this process's
    environment; a fresh one for a single-node job; a multi-node job must be given one).
    """

    nprocs: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    prefix_output: bool = True
    grace: float = 3.0
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("nprocs", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node launch needs --master-port (the same on every node)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.nnodes > 1 and not os.environ.get(TOKEN_VAR) and not self.env.get(TOKEN_VAR):
            raise ValueError(f"a multi-node launch needs the job secret {TOKEN_VAR}, the same on "
                             f"every node: export {TOKEN_VAR}=$(python3 -c 'import secrets; "
                             "print(secrets.token_hex(32))') and pass it to every node")


class _Ranks:
    """The running rank processes, their output pumps, exit waiters and last lines of each."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.tails: dict[int, collections.deque[str]] = {}
        self.threads: list[threading.Thread] = []
        self.exits: list[tuple[float, int, int]] = []  # (time, rank, code) in order of exit
        self.changed = threading.Event()  # a rank exited, or the launcher got a signal
        self.signal: int | None = None

    def start(self, rank: int, argv: list[str], env: dict[str, str], prefix: bool) -> None:
        try:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    bufsize=1, start_new_session=True, errors="replace",
                                    preexec_fn=die_with_parent(os.getpid()))
        except OSError as err:
            raise ValueError(f"cannot start rank {rank} ({argv[0]}): {err.strerror}") from err
        self.procs[rank] = proc
        self.tails[rank] = collections.deque(maxlen=30)
        for target in (self._pump, self._reap):
            thread = threading.Thread(target=target, args=(rank, proc, prefix), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pump(self, rank: int, proc: subprocess.Popen[str], prefix: bool) -> None:
        assert proc.stdout is not None
        tag = f"[rank {rank}] " if prefix else ""
        for line in proc.stdout:
            self.tails[rank].append(line.rstrip("\n"))
            with self.lock:
                self.out.write(tag + line)
                self.out.flush()

    def _reap(self, rank: int, proc: subprocess.Popen[str], _prefix: bool) -> None:
        code = proc.wait()  # the only waiter of this process: its exit time is exact
        with self.lock:
            self.exits.append((time.monotonic(), rank, code))
        self.changed.set()

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal = signum
        self.changed.set()

    def watch(self) -> tuple[int, int] | None:
        """Wait until every rank exits (None), one fails ((rank, code)) or a signal (None)."""
        while self.signal is None:
            with self.lock:
                failed = [(rank, code) for _, rank, code in self.exits if code != 0]
                done = len(self.exits) == len(self.procs)
            if failed:
                return failed[0]
            if done:
                return None
            self.changed.wait(0.5)
            self.changed.clear()
        return None

    def stop(self, grace: float) -> None:
        """SIGTERM to every live rank's process group, SIGKILL after ``grace`` seconds."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs.values() if p.returncode is None]
            for proc in alive:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and not self._all_exited():
                time.sleep(0.02)
            if self._all_exited():
                break
        for thread in self.threads:
            thread.join(timeout=2.0)

    def _all_exited(self) -> bool:
        with self.lock:
            return len(self.exits) == len(self.procs)

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, code) of the rank whose non-zero exit came first, if any."""
        with self.lock:
            failed = [(rank, code) for _, rank, code in sorted(self.exits) if code != 0]
        return failed[0] if failed else None


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def launch(target: Sequence[str], config: LaunchConfig, *, wrapper: RankWrapper | None = None,
           out: IO[str] | None = None) -> int:
    """Run ``target`` as ``config.nprocs`` ranks of this node and wait for them.

    Args:
        target: ``script.py [args]``, ``-m module [args]`` or an executable's argv.
        config: the launch layout.
        wrapper: per local rank, an argv prefix and environment (used by the testbed).
        out: where rank output goes (default ``sys.stdout``).

    Returns:
        0 when every rank succeeded; else the exit code of the rank that failed first
        (128 + N for a rank killed by signal N); 128 + N when the launcher got signal N
        (SIGTERM, SIGHUP, SIGINT), after stopping every rank.

    Raises:
        ValueError: the target cannot be found or a rank cannot be started.
    """
    out = sys.stdout if out is None else out
    argv = command_for(target)
    port = config.master_port if config.master_port is not None else free_port()
    world = config.nprocs * config.nnodes
    token = config.env.get(TOKEN_VAR) or os.environ.get(TOKEN_VAR) or new_token()
    ranks = _Ranks(out)
    threads = max(1, (os.cpu_count() or 1) // config.nprocs)
    reports = tempfile.TemporaryDirectory(prefix="scaleout-run-")
    in_main = threading.current_thread() is threading.main_thread()
    previous = ({sig: signal.signal(sig, ranks.on_signal) for sig in _STOP_SIGNALS}
                if in_main else {})
    try:
        for local in range(config.nprocs):
            rank = config.node_rank * config.nprocs + local
            prefix, extra = wrapper(local) if wrapper is not None else ([], {})
            env = {
                **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                **config.env, "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(config.nprocs),
                "GROUP_RANK": str(config.node_rank), "MASTER_ADDR": config.master_addr,
                "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
                LAUNCHER_PID_VAR: str(os.getpid()), TOKEN_VAR: token,
                REPORT_DIR_VAR: reports.name, **extra,
            }
            if ranks.signal is None:
                ranks.start(rank, [*prefix, *argv], env, config.prefix_output)
        ranks.watch()
    finally:
        ranks.stop(config.grace)  # every rank, also after an exception
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    with reports:
        return _report(ranks, out, blamed(reports.name))


def _report(ranks: _Ranks, out: IO[str], blame: Mapping[str, object] | None) -> int:
    """Say why the job ended and return the launcher's exit code."""
    if ranks.signal is not None:
        name = _signal_name(ranks.signal)
        out.write(f"scaleout run: got {name}; stopped every rank\n")
        out.flush()
        return 128 + ranks.signal
    failed = ranks.first_failure()
    if failed is None:
        return 0
    rank, code = failed
    how = f"exit code {code}" if code > 0 else f"signal {_signal_name(-code)}"
    tail = "\n".join(f"    {line}" for line in ranks.tails[rank])
    if blame is not None and blame.get("rank") != rank:  # rank exited because a peer failed
        out.write(f"scaleout run: rank {blame['rank']} failed first: {blame['reason']} (noticed "
                  f"by rank {blame['detected_by']}); rank {rank} then exited with {how}; stopped "
                  f"the other ranks. Last output of rank {rank}:\n{tail}\n")
    else:
        out.write(f"scaleout run: rank {rank} failed first, with {how}; stopped the other "
                  f"ranks. Last output of rank {rank}:\n{tail}\n")
    out.flush()
    return code if code > 0 else 128 - code  # a signal -N becomes 128+N


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
