"""Start N local ranks with the torchrun variables set; stop them all when one fails.

:func:`launch` is what ``scaleout run`` calls. Each rank's output lines are prefixed with
``[rank R]``. When a rank exits non-zero, the others are stopped and the launcher returns
that rank's exit code, after repeating the end of its output.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

__all__ = ["LaunchConfig", "RankWrapper", "launch", "free_port", "command_for"]

# Per local rank: (argv prefix, extra environment), e.g. to run inside a testbed host.
RankWrapper = Callable[[int], tuple[list[str], dict[str, str]]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command_for(target: Sequence[str]) -> list[str]:
    """The argv that runs ``target``: a ``.py`` script or ``-m module`` under this Python."""
    target = list(target)
    if not target:
        raise ValueError("nothing to run: give a script (script.py [args]) or -m module [args]")
    if target[0] == "-m" or target[0].endswith(".py"):
        return [sys.executable, "-u", *target]
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


class _Ranks:
    """The running rank processes, their output pumps and the last lines of each."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.tails: dict[int, collections.deque[str]] = {}
        self.pumps: list[threading.Thread] = []

    def start(self, rank: int, argv: list[str], env: dict[str, str], prefix: bool) -> None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                start_new_session=True, errors="replace")
        self.procs[rank] = proc
        self.tails[rank] = collections.deque(maxlen=30)
        pump = threading.Thread(target=self._pump, args=(rank, proc, prefix), daemon=True)
        pump.start()
        self.pumps.append(pump)

    def _pump(self, rank: int, proc: subprocess.Popen[str], prefix: bool) -> None:
        assert proc.stdout is not None
        tag = f"[rank {rank}] " if prefix else ""
        for line in proc.stdout:
            self.tails[rank].append(line.rstrip("\n"))
            with self.lock:
                self.out.write(tag + line)
                self.out.flush()

    def stop(self, grace: float) -> None:
        alive = [p for p in self.procs.values() if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in alive:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                time.sleep(0.05)
            alive = [p for p in alive if p.poll() is None]
            if not alive:
                break
        for proc in self.procs.values():
            proc.wait()
        for pump in self.pumps:
            pump.join(timeout=2.0)


def launch(target: Sequence[str], config: LaunchConfig, *, wrapper: RankWrapper | None = None,
           out: IO[str] | None = None) -> int:
    """Run ``target`` as ``config.nprocs`` ranks of this node and wait for them.

    Args:
        target: ``script.py [args]``, ``-m module [args]`` or an executable's argv.
        config: the launch layout.
        wrapper: per local rank, an argv prefix and environment (used by the testbed).
        out: where rank output goes (default ``sys.stdout``).

    Returns:
        0 when every rank succeeded, else the exit code of the first rank that failed
        (130 after Ctrl-C).
    """
    out = sys.stdout if out is None else out
    argv = command_for(target)
    port = config.master_port if config.master_port is not None else free_port()
    world = config.nprocs * config.nnodes
    ranks = _Ranks(out)
    threads = max(1, (os.cpu_count() or 1) // config.nprocs)
    try:
        for local in range(config.nprocs):
            rank = config.node_rank * config.nprocs + local
            prefix, extra = wrapper(local) if wrapper is not None else ([], {})
            env = {
                **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
                **config.env, "RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(config.nprocs),
                "GROUP_RANK": str(config.node_rank), "MASTER_ADDR": config.master_addr,
                "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", **extra,
            }
            ranks.start(rank, [*prefix, *argv], env, config.prefix_output)
        failed = _watch(ranks)
    except KeyboardInterrupt:
        ranks.stop(config.grace)
        out.write("scaleout run: interrupted; stopped every rank\n")
        return 130
    if failed is None:
        ranks.stop(config.grace)
        return 0
    rank, code = failed
    ranks.stop(config.grace)
    tail = "\n".join(f"    {line}" for line in ranks.tails[rank])
    out.write(f"scaleout run: rank {rank} failed with exit code {code}; stopped the other "
              f"ranks. Last output of rank {rank}:\n{tail}\n")
    out.flush()
    return code if code > 0 else 128 - code  # a signal -N becomes 128+N


def _watch(ranks: _Ranks) -> tuple[int, int] | None:
    """Wait until every rank exits (None) or one fails ((rank, exit code))."""
    while True:
        running = False
        for rank, proc in ranks.procs.items():
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0:
                return rank, code
        if not running:
            return None
        time.sleep(0.05)
