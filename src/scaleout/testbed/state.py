"""The small JSON file that lets other processes attach to an up testbed.

``scaleout testbed up`` writes ``<state dir>/<name>.json``; ``scaleout run
--testbed NAME`` (or :meth:`Testbed.attach`) reads it. The directory is
``$SCALEOUT_TESTBED_DIR`` if set, else ``/run/scaleout/testbed`` (``/run`` is a
tmpfs, so state never outlives a reboot that already removed the namespaces).

A testbed brought up by a Python ``with`` block records its owner (pid and process
start time); once that process is gone the testbed is *stale* and the next ``up``
removes it. A testbed brought up by the CLI has no owner and lives until ``down``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from scaleout.testbed.config import TestbedConfig
from scaleout.testbed.host import HostInfo

__all__ = ["TestbedState", "state_dir", "process_start_time", "owner_alive"]

STATE_DIR_ENV = "SCALEOUT_TESTBED_DIR"
DEFAULT_STATE_DIR = "/run/scaleout/testbed"


def state_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding testbed state files.

    Args:
        directory: an explicit directory; wins over the environment.

    Returns:
        ``directory``, else ``$SCALEOUT_TESTBED_DIR``, else ``/run/scaleout/testbed``.
    """
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if gone.

    Together with the pid it identifies a process even when pids are reused. A process
    that exited but that its parent has not reaped yet (a zombie) is gone: it runs no
    more code, so it can never take its testbed down.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields 3 (state) and 22; the command name (field 2) may hold spaces, so split after ")".
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def owner_alive(pid: int | None, start: str | None) -> bool:
    """Whether the owner recorded in a state file still runs (``True`` if no owner)."""
    if pid is None:
        return True
    return process_start_time(pid) == start


@dataclass(frozen=True, kw_only=True)
class TestbedState:
    """Everything needed to use or remove an up testbed.

    Attributes:
        config: the configuration it was brought up with (``subnet`` filled in).
        switch_namespace: the namespace holding the bridge.
        hosts: one :class:`HostInfo` per host, by index.
        burst_bytes: token bucket size of the rate shapers.
        limit_bytes: queue limit of the rate shapers.
        owner_pid: pid of the process whose ``with`` block owns it, ``None`` for CLI.
        owner_start: that process's start time (see :func:`process_start_time`).
        created: creation time, seconds since the epoch.
    """

    __test__ = False  # not a pytest class

    config: TestbedConfig
    switch_namespace: str
    hosts: tuple[HostInfo, ...]
    burst_bytes: int
    limit_bytes: int
    owner_pid: int | None = None
    owner_start: str | None = None
    created: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        """The testbed name."""
        return self.config.name

    @property
    def namespaces(self) -> tuple[str, ...]:
        """All namespaces of the testbed: hosts, then the switch."""
        return (*(h.namespace for h in self.hosts), self.switch_namespace)

    @property
    def stale(self) -> bool:
        """Whether its owning process has exited (CLI testbeds are never stale)."""
        return not owner_alive(self.owner_pid, self.owner_start)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        cfg = self.config
        return {
            "name": cfg.name,
            "config": {
                "hosts": cfg.hosts, "rate": cfg.rate, "delay": cfg.delay, "jitter": cfg.jitter,
                "loss": cfg.loss, "mtu": cfg.mtu, "name": cfg.name, "subnet": cfg.subnet,
            },
            "switch_namespace": self.switch_namespace,
            "hosts": [h.to_dict() for h in self.hosts],
            "burst_bytes": self.burst_bytes,
            "limit_bytes": self.limit_bytes,
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TestbedState:
        """Inverse of :meth:`to_dict`."""
        return cls(
            config=TestbedConfig(**data["config"]),  # type: ignore[arg-type]
            switch_namespace=str(data["switch_namespace"]),
            hosts=tuple(HostInfo.from_dict(h) for h in data["hosts"]),  # type: ignore[union-attr]
            burst_bytes=int(data["burst_bytes"]),  # type: ignore[arg-type]
            limit_bytes=int(data["limit_bytes"]),  # type: ignore[arg-type]
            owner_pid=data.get("owner_pid"),  # type: ignore[arg-type]
            owner_start=data.get("owner_start"),  # type: ignore[arg-type]
            created=float(data.get("created", 0.0)),  # type: ignore[arg-type]
        )

    def save(self, directory: Path) -> Path:
        """Write ``<directory>/<name>.json`` atomically and return its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> TestbedState:
        """Read a state file written by :meth:`save`.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not a testbed state file.
        """
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a testbed state file ({err})") from err
