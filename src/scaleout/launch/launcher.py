"""Start N local ranks with the torchrun variables set; stop them all when one fails.

:func:`launch` is what ``scaleout run`` calls. Each rank's output lines are prefixed with
``[rank R]``. The launcher owns its ranks:

- when a rank exits non-zero, the others are stopped (SIGTERM to each rank's process group,
  SIGKILL after ``grace`` seconds) and the launcher returns the exit code of the rank that
  failed *first* (by time of exit: a rank that fails because a peer died is not blamed),
  after repeating the end of its output;
- SIGTERM, SIGHUP or SIGINT to the launcher stop every rank the same way and it returns
  128 + the signal number; a stop signal it inherited as ignored (``nohup``, ``&`` in a
  script) stays ignored;
- a rank, and what it started, die with the launcher (``kill -9`` included): see
  :mod:`scaleout.launch.lifeline` and :mod:`scaleout.launch.guardian`;
- when the job fails after some ranks had already exited (code 0: a rank that returned
  early), the report names them too: the others fail because a peer left;
- with ``max_restarts=K`` a failed job is started again, every rank, up to K times, each
  attempt with a fresh rendezvous (a new port, and a new token unless the user gave one);
  the ranks learn the attempt from ``SCALEOUT_RESTART_COUNT`` (see
  :mod:`scaleout.launch.restarts`) and resume from their last checkpoint.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from scaleout.launch.allocator import DEFAULT_ALLOCATOR, allocator_env, check_allocator
from scaleout.launch.lifeline import REPORT_DIR_VAR, blamed, launcher_env
from scaleout.launch.ranks import Ranks, signal_name, write_out
from scaleout.launch.subreaper import become_subreaper
from scaleout.launch.restarts import STATE_DIR_VAR, attempt_env
from scaleout.launch.secret import TOKEN_VAR, new_token
from scaleout.launch.stop_signals import restore_signals, take_stop_signals

__all__ = ["LINGERED_SAY", "LaunchConfig", "RankWrapper", "launch", "free_port", "command_for",
           "node_command"]

#: How the launcher's line begins when it stopped ranks that outstayed ``linger``.
LINGERED_SAY = "scaleout run: not exiting"

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
        if len(target) < 2 or not target[1].strip() or target[1].startswith("-"):
            raise ValueError("-m needs a module name: -m module [args]")
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
        settle: after the first rank fails, seconds the others get to end by themselves
            (each survivor's watchdog names the failed rank within about a second on one
            node) before they are stopped; they are stopped at once when all have ended.
        linger: after the first rank exits with 0, seconds the others get to exit too;
            any still running then is stopped, named, and the job fails (it finished its
            work but not its exit: a hang at teardown). ``None`` waits for them as long as
            they run (a rank 0 that evaluates or saves after the others left is common).
        max_restarts: after a failure, start every rank again up to this many times
            (single node only: restarts across nodes are not coordinated).
        env: extra environment for every rank.
        allocator: every rank's host allocator, ``"keep"`` (freed memory reused, not returned
            to the kernel) or ``"system"`` (glibc's defaults): :mod:`scaleout.launch.allocator`.
        testbed: the testbed (``--testbed``) ``wrapper`` places the ranks on, also named in
            the command printed for the other nodes; ``None``: none.

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
    settle: float = 5.0
    linger: float | None = None
    max_restarts: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    allocator: str = DEFAULT_ALLOCATOR
    testbed: str | None = None

    def __post_init__(self) -> None:
        check_allocator(self.allocator)
        if self.testbed is not None and not (isinstance(self.testbed, str) and self.testbed):
            raise ValueError(f"testbed must be a testbed's name or None, got {self.testbed!r}")
        for name in ("nprocs", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("grace", "settle", "linger"):
            value = getattr(self, name)
            if (value is not None or name != "linger") and (isinstance(value, bool) or not
                    isinstance(value, (int, float)) or not 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if (isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int)
                or self.max_restarts < 0):
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.max_restarts and self.nnodes > 1:
            raise ValueError("--max-restarts works on a single node only (restarts are not "
                             "coordinated across nodes): drop it, or restart the job from "
                             "its checkpoint on every node")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip() or any(
                char.isspace() for char in self.master_addr):
            raise ValueError(f"master_addr must be a host name or address, got "
                             f"{self.master_addr!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node launch needs --master-port (the same on every node)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.nnodes > 1 and not os.environ.get(TOKEN_VAR) and not self.env.get(TOKEN_VAR):
            raise ValueError(f"a multi-node launch needs the job secret {TOKEN_VAR}, the same on "
                             f"every node: export {TOKEN_VAR}=$(python3 -c 'import secrets; "
                             "print(secrets.token_hex(32))') and pass it to every node")


class _Signals:
    """The launcher's stop signal, forwarded to the ranks of the current attempt."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.ranks: Ranks | None = None

    def handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        if self.ranks is not None:
            self.ranks.on_signal(signum, frame)


def launch(target: Sequence[str], config: LaunchConfig, *, wrapper: RankWrapper | None = None,
           out: IO[str] | None = None, stop: threading.Event | None = None) -> int:
    """Run ``target`` as ``config.nprocs`` ranks of this node and wait for them.

    Args:
        target: ``script.py [args]``, ``-m module [args]`` or an executable's argv.
        config: the launch layout.
        wrapper: per local rank, an argv prefix and environment (used by the testbed).
        out: where rank output goes (default ``sys.stdout``).
        stop: when set (from another thread), the launch ends as on SIGTERM: every rank is
            stopped and the exit code is ``128 + SIGTERM``. For a launch that runs in a
            thread other than the main one, where no signal handler can be installed.

    Returns:
        0 when every rank succeeded (after at most ``config.max_restarts`` restarts); else
        the exit code of the rank that failed first in the last attempt (128 + N for a rank
        killed by signal N); 128 + N when the launcher got signal N (SIGTERM, SIGHUP,
        SIGINT), after stopping every rank. What happened is written to ``out``.

    Raises:
        ValueError: the target cannot be found or a rank cannot be started.
    """
    out = sys.stdout if out is None else out
    argv = command_for(target)
    become_subreaper()  # (orphans of the ranks' descendants come here: Ranks.stop ends them)
    if config.nnodes > 1 and config.node_rank == 0:
        _say(out, _other_nodes(target, config))
    signals = _Signals()
    in_main = threading.current_thread() is threading.main_thread()
    previous = take_stop_signals(signals.handle) if in_main else {}
    ended = threading.Event()
    if stop is not None:
        threading.Thread(target=_forward_stop, args=(stop, ended, signals), daemon=True,
                         name="scaleout-launch-stop").start()
    try:
        with tempfile.TemporaryDirectory(prefix="scaleout-run-") as workdir:
            state = (config.env.get(STATE_DIR_VAR) or os.environ.get(STATE_DIR_VAR)
                     or os.path.join(workdir, "state"))
            try:
                os.makedirs(state, exist_ok=True)
            except OSError as err:
                raise ValueError(f"{STATE_DIR_VAR} = {state!r} cannot be used as the run's "
                                 f"state folder: {err.strerror}") from None
            return _attempts(argv, config, wrapper, out, signals, workdir, state)
    finally:
        ended.set()
        restore_signals(previous)


def _forward_stop(stop: threading.Event, ended: threading.Event, signals: _Signals) -> None:
    """Turn ``stop`` into a SIGTERM for the launch, until the launch has ended."""
    while not ended.is_set():
        if stop.wait(0.1):
            signals.handle(signal.SIGTERM, None)
            return


def _attempts(argv: list[str], config: LaunchConfig, wrapper: RankWrapper | None,
              out: IO[str], signals: _Signals, workdir: str, state: str) -> int:
    """Run attempt after attempt until one succeeds, a signal stops the job or the budget
    of restarts is spent; return the launcher's exit code."""
    causes: list[str] = []
    attempt = 0
    while True:
        reports = os.path.join(workdir, f"reports-{attempt}")
        os.mkdir(reports)
        env = {**attempt_env(attempt, config.max_restarts, state), REPORT_DIR_VAR: reports}
        ranks = _run_once(argv, config, wrapper, out, signals, env)
        code, cause = _report(ranks, out, blamed(reports), config.linger)
        if code == 0:
            if causes:
                _say(out, f"scaleout run: every rank finished after {_restarts(len(causes))} "
                          f"({'; '.join(causes)})")
            return 0
        if signals.signum is not None:  # the launcher was told to stop: never retried
            return code
        causes.append(f"attempt {attempt}: {cause}")
        if attempt == config.max_restarts:
            if config.max_restarts:
                _say(out, f"scaleout run: gave up after {_restarts(attempt)} (--max-restarts "
                          f"{config.max_restarts} spent): {'; '.join(causes)}")
            return code
        attempt += 1
        _say(out, f"scaleout run: restart {attempt} of {config.max_restarts}: starting every "
                  "rank again with a fresh rendezvous")


def usable_cpus() -> int:
    """The CPUs this process may run on (a cpuset, ``taskset``, Slurm's binding), which
    ``os.cpu_count()`` ignores: ranks given the node's count oversubscribe a share of it."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (not on Linux)
        return max(1, os.cpu_count() or 1)


def _run_once(argv: list[str], config: LaunchConfig, wrapper: RankWrapper | None,
              out: IO[str], signals: _Signals, attempt: Mapping[str, str]) -> Ranks:
    """Start every rank of this node, wait until they end, stop them; return them."""
    port = config.master_port if config.master_port is not None else free_port()
    world = config.nprocs * config.nnodes
    token = config.env.get(TOKEN_VAR) or os.environ.get(TOKEN_VAR) or new_token()
    threads = max(1, usable_cpus() // config.nprocs)
    launcher = launcher_env()
    memory = allocator_env(config.allocator, {**os.environ, **config.env})
    ranks = Ranks(out)
    signals.ranks = ranks
    if signals.signum is not None:
        ranks.on_signal(signals.signum, None)
    try:
        for local in range(config.nprocs):
            rank = config.node_rank * config.nprocs + local
            prefix, extra = wrapper(local) if wrapper is not None else ([], {})
            env = {
                **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                **config.env, **memory, "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(config.nprocs),
                "GROUP_RANK": str(config.node_rank), "MASTER_ADDR": config.master_addr,
                "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
                # the rest of what torchrun sets (one role, as torchrun's default; the run's
                # id names its rendezvous, the same on every node)
                "GROUP_WORLD_SIZE": str(config.nnodes), "ROLE_NAME": "default",
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
                "TORCHELASTIC_RUN_ID": f"scaleout-{config.master_addr}-{port}",
                "TORCHELASTIC_USE_AGENT_STORE": "False",  # (rank 0 serves it: not inherited)
                **launcher, TOKEN_VAR: token, **attempt, **extra,
            }
            if ranks.signal is None:
                ranks.start(rank, [*prefix, *argv], env, config.prefix_output)
        ranks.watch(config.settle, config.linger)
    finally:
        ranks.stop(config.grace)  # every rank, also after an exception
    return ranks


def _report(ranks: Ranks, out: IO[str], blame: Mapping[str, object] | None,
            linger: float | None) -> tuple[int, str]:
    """Say why the attempt ended; return the launcher's exit code and the cause in brief."""
    if ranks.signal is not None:
        name = signal_name(ranks.signal)
        failed = ranks.first_failure(before=ranks.signal_at)  # (not one the stop ended)
        before = (f" (rank {failed[0]} had failed before it, with {_how(failed[1])})"
                  if failed is not None else "")
        _say(out, f"scaleout run: got {name}; stopped every rank{before}")
        return 128 + ranks.signal, f"got {name}"
    if ranks.lingered:
        names = ", ".join(f"rank {rank}" for rank in ranks.lingered)
        first = min((at, rank) for at, rank, code in ranks.exits if code == 0)[1]
        cause = (f"{names} still running {linger:g} s after rank {first} exited with code 0 "
                 "(done, yet not exiting: a hang at teardown?)")
        _say(out, f"{LINGERED_SAY}: {cause}; stopped "
                  f"{'it' if len(ranks.lingered) == 1 else 'them'}")
        return 1, cause
    failed = ranks.first_failure()
    if failed is None:
        return 0, ""
    rank, code = failed
    how = _how(code)
    tail = "\n".join(f"    {line}" for line in ranks.tails[rank])
    if blame is not None and blame.get("rank") != rank:  # rank exited because a peer failed
        cause = f"rank {blame['rank']} failed first: {blame['reason']}"
        _say(out, f"scaleout run: {cause} (noticed by rank {blame['detected_by']}); rank {rank} "
                  f"then exited with {how}; stopped the other ranks. Last output of rank "
                  f"{rank}:\n{tail}")
    else:
        cause = f"rank {rank} failed first, with {how}"
        _say(out, f"scaleout run: {cause}; stopped the other ranks. Last output of rank "
                  f"{rank}:\n{tail}")
    early = ranks.exited_before(rank)
    if early:
        _say(out, f"scaleout run: {_early_exits(early, rank)}")
        cause += f" (after {', '.join(f'rank {who}' for who, _, _ in early)} had exited)"
    return (code if code > 0 else 128 - code), cause  # a signal -N becomes 128+N


def _how(code: int) -> str:
    """How a rank ended, from its exit status (``-N``: killed by signal N)."""
    return f"exit code {code}" if code > 0 else f"signal {signal_name(-code)}"


def _early_exits(early: list[tuple[int, int, float]], rank: int) -> str:
    """Ranks that left before ``rank`` failed: the likely cause of its failure."""
    said = "; ".join(f"rank {who} had exited (code {code}) {ago:.1f} s before rank {rank} "
                     "failed" for who, code, ago in early)
    return (f"{said}: a rank that leaves while others still communicate makes them fail "
            "(did it return or call sys.exit() before the others were done?)")


def _restarts(count: int) -> str:
    return f"{count} restart" + ("" if count == 1 else "s")


def _say(out: IO[str], message: str) -> None:
    write_out(out, message + "\n")  # (a reader that left, as `| head` does, is no error)


def node_command(target: Sequence[str], config: LaunchConfig, node_rank: int) -> str:
    """The ``scaleout run`` command line that starts node ``node_rank`` of this job."""
    options = ["-n", str(config.nprocs), "--nnodes", str(config.nnodes), "--node-rank",
               str(node_rank), "--master-addr", config.master_addr, "--master-port",
               str(config.master_port)]
    if not config.prefix_output:
        options.append("--no-prefix")
    if config.allocator != DEFAULT_ALLOCATOR:
        options += ["--allocator", config.allocator]
    options += ["--linger", f"{config.linger:g}"] if config.linger is not None else []
    # (since stop 52; before, those nodes ran off the testbed)
    options += ["--testbed", config.testbed] if config.testbed is not None else []
    return shlex.join(["scaleout", "run", *options, *target])


def _other_nodes(target: Sequence[str], config: LaunchConfig) -> str:
    """Node 0's note: the command of every other node; the token by name, never its value."""
    lines = [f"scaleout run: node 0 of {config.nnodes}; start the other nodes (within the "
             f"rendezvous timeout) with {TOKEN_VAR} exported to the same secret as on this "
             "node (not shown here):"]
    lines += [f"  {node_command(target, config, node)}" for node in range(1, config.nnodes)]
    if config.master_addr.startswith("127.") or config.master_addr == "localhost":
        lines.append(f"  (--master-addr {config.master_addr} is loopback: those nodes must run "
                     "on this machine; give this node's address otherwise)")
    return "\n".join(lines)
