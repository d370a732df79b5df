"""Bringing an emulated cluster up and down: :class:`Testbed`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from scaleout.testbed import hostnames, naming
from scaleout.testbed.config import DEFAULT_NAME, TestbedConfig
from scaleout.testbed.errors import TestbedError, TestbedUnavailable
from scaleout.testbed.host import HostInfo
from scaleout.testbed.shaping import plan_link
from scaleout.testbed.state import TestbedState, process_start_time, state_dir
from scaleout.testbed.system import System, check_capabilities

__all__ = ["Testbed", "list_testbeds", "remove_stale"]

_FREE_PORT_SNIPPET = (
    "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
)


class Testbed:
    """An emulated cluster of network namespaces joined by a shaped switch.

    Use it as a context manager; the testbed is removed on exit, on an exception
    and on Ctrl-C, and if the process is killed, the next :meth:`up` of any
    testbed removes it as stale.

    Args:
        config: the cluster to emulate.
        directory: where state files live (default: see :func:`state.state_dir`).
        system: runs ``ip``/``tc`` (default: a new :class:`System`).

    Example:
        >>> with Testbed(TestbedConfig(hosts=2, rate="1gbit")) as tb:  # doctest: +SKIP
        ...     h1 = tb.hosts[1]
        ...     subprocess.run(h1.command(["python", "-c", "print(1)"]),
        ...                    env={**os.environ, **h1.env()})
    """

    __test__ = False  # not a pytest class

    def __init__(
        self,
        config: TestbedConfig,
        *,
        directory: str | os.PathLike[str] | None = None,
        system: System | None = None,
    ) -> None:
        if not isinstance(config, TestbedConfig):
            raise TypeError(f"config: expected a TestbedConfig, got {type(config).__name__}")
        self._config = config
        self._dir = state_dir(directory)
        self._system = system if system is not None else System()
        self._state: TestbedState | None = None
        self._attached = False

    # -- attaching -------------------------------------------------------------

    @classmethod
    def attach(
        cls,
        name: str = DEFAULT_NAME,
        *,
        directory: str | os.PathLike[str] | None = None,
        system: System | None = None,
    ) -> Testbed:
        """Use a testbed that is already up (e.g. from ``scaleout testbed up``).

        The returned object does not own the testbed: leaving a ``with`` block on
        it does not bring it down (call :meth:`down` for that).

        Args:
            name: the testbed name.
            directory: where state files live.
            system: runs ``ip``/``tc``.

        Returns:
            A :class:`Testbed` whose :attr:`hosts` describe the running testbed.

        Raises:
            TestbedError: no such testbed is up, or it is stale.
        """
        path = state_dir(directory) / f"{name}.json"
        try:
            state = TestbedState.load(path)
        except FileNotFoundError as err:
            raise TestbedError(
                f"no testbed named {name!r} is up (no {path}); start one with "
                f"`scaleout testbed up --name {name} --hosts 2 --rate 1gbit`"
            ) from err
        if state.stale:
            raise TestbedError(
                f"testbed {name!r} is stale (its owner pid {state.owner_pid} exited); "
                "remove it with `scaleout testbed down`"
            )
        tb = cls(state.config, directory=directory, system=system)
        tb._state = state
        tb._attached = True
        return tb

    # -- properties ------------------------------------------------------------

    @property
    def config(self) -> TestbedConfig:
        """The configuration (``subnet`` filled in once up)."""
        return self._state.config if self._state is not None else self._config

    @property
    def state(self) -> TestbedState:
        """The running testbed's state.

        Raises:
            TestbedError: it is not up.
        """
        if self._state is None:
            raise TestbedError(f"testbed {self._config.name!r} is not up; call up() or use `with`")
        return self._state

    @property
    def hosts(self) -> tuple[HostInfo, ...]:
        """The hosts, by index (see :class:`HostInfo` for launching ranks on them)."""
        return self.state.hosts

    @property
    def master_addr(self) -> str:
        """Host 0's address (the rendezvous address, ``MASTER_ADDR``)."""
        return self.state.hosts[0].address

    def free_port(self, host: int = 0) -> int:
        """A TCP port free inside host ``host`` (e.g. for ``MASTER_PORT``).

        Args:
            host: host index.

        Returns:
            A port the kernel picked as free in that namespace.
        """
        result = self._system.in_netns(
            self.hosts[host].namespace, [sys.executable, "-c", _FREE_PORT_SNIPPET]
        )
        return int(result.stdout.strip())

    # -- lifecycle -------------------------------------------------------------

    def up(self, *, persistent: bool = False) -> TestbedState:
        """Create namespaces, switch, links, addresses and shaping.

        Stale testbeds (owner gone) are removed first.

        Args:
            persistent: outlive this process (what ``scaleout testbed up`` does);
                otherwise it is owned by this process and removed as stale once
                this process is gone.

        Returns:
            The state, also written to ``<state dir>/<name>.json``.

        Raises:
            TestbedUnavailable: not root, ``ip``/``tc`` missing, or the kernel lacks
                ``netem`` while delay, jitter or loss is asked for.
            TestbedError: a testbed of this name is already up, or a command failed
                (whatever was created is removed again).
            ValueError: the configuration's ``subnet`` overlaps that of another live
                testbed of this state directory, or no free subnet is left to choose.
        """
        if self._state is not None:
            raise TestbedError(f"testbed {self._config.name!r} is already up")
        check_capabilities()
        with _lock(self._dir):
            remove_stale(
                directory=self._dir, system=self._system, orphans_of=self._config.name, locked=True
            )
            existing = self._dir / f"{self._config.name}.json"
            if existing.exists():
                raise TestbedError(
                    f"testbed {self._config.name!r} is already up ({existing}); use it with "
                    f"Testbed.attach({self._config.name!r}), or remove it with "
                    f"`scaleout testbed down --name {self._config.name}`"
                )
            state = self._plan()
            state.save(self._dir)  # first, so a crash mid-way leaves a stale, removable record
            try:
                self._build(state)
            except BaseException:
                _teardown(state, self._dir, self._system)
                raise
            if persistent:
                state = replace(state, owner_pid=None, owner_start=None)
                state.save(self._dir)
        self._state = state
        return state

    def down(self) -> None:
        """Remove the namespaces (and with them links and shaping) and the state file.

        Safe to call when already down.
        """
        state = self._state
        if state is None:
            return
        with _lock(self._dir):
            _teardown(state, self._dir, self._system)
        self._state = None

    def __enter__(self) -> Testbed:
        if self._state is None:
            self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not getattr(self, "_attached", False):
            self.down()

    # -- internals -------------------------------------------------------------

    def _plan(self) -> TestbedState:
        cfg = self._config
        live = [s for s in list_testbeds(directory=self._dir) if s.config.subnet and not s.stale]
        if cfg.subnet is None:
            taken = [s.config.subnet for s in live]
            cfg = replace(cfg, subnet=naming.choose_subnet(naming.used_networks(self._system), taken))
        else:  # since stop 52; before, a second testbed came up on the first one's addresses
            naming.check_subnet_free(cfg.subnet, {s.name: s.config.subnet for s in live})
        assert cfg.subnet is not None
        master = naming.host_address(cfg.subnet, 0)
        hosts = tuple(
            HostInfo(
                index=i,
                namespace=naming.host_namespace(cfg.name, i),
                ifname=naming.HOST_IFNAME,
                address=naming.host_address(cfg.subnet, i),
                master_addr=master,
            )
            for i in range(cfg.hosts)
        )
        shaping = plan_link(cfg, host_dev=naming.HOST_IFNAME, switch_dev=naming.switch_port(0))
        pid = os.getpid()
        return TestbedState(
            config=cfg,
            switch_namespace=naming.switch_namespace(cfg.name),
            hosts=hosts,
            burst_bytes=shaping.burst_bytes,
            limit_bytes=shaping.limit_bytes,
            owner_pid=pid,
            owner_start=process_start_time(pid),
        )

    def _build(self, state: TestbedState) -> None:
        run, cfg, sw = self._system.run, state.config, state.switch_namespace
        present = set(self._system.namespaces())
        clashes = [ns for ns in state.namespaces if ns in present]
        if clashes:
            raise TestbedError(f"namespaces {clashes} already exist; run `scaleout testbed down --name {cfg.name}`")
        run(["ip", "netns", "add", sw])
        _quiet_ipv6(self._system, sw)
        if cfg.needs_netem and not self._system.has_qdisc(sw, "netem"):
            raise TestbedUnavailable(
                "delay, jitter and loss need the kernel's netem qdisc (CONFIG_NET_SCH_NETEM, "
                "module sch_netem), which this kernel lacks; rate shaping works without it "
                f"(asked for delay={cfg.delay} jitter={cfg.jitter} loss={cfg.loss})"
            )
        run(["ip", "-n", sw, "link", "add", naming.BRIDGE_IFNAME, "mtu", str(cfg.mtu), "type", "bridge"])
        run(["ip", "-n", sw, "link", "set", naming.BRIDGE_IFNAME, "up"])
        for host in state.hosts:
            ns, port = host.namespace, naming.switch_port(host.index)
            run(["ip", "netns", "add", ns])
            _quiet_ipv6(self._system, ns)
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", sw, "link", "add", port, "mtu", str(cfg.mtu), "type", "veth",
                 "peer", "name", host.ifname, "netns", ns])
            run(["ip", "-n", sw, "link", "set", port, "master", naming.BRIDGE_IFNAME, "up"])
            run(["ip", "-n", ns, "link", "set", host.ifname, "mtu", str(cfg.mtu), "up"])
            prefix = cfg.subnet.split("/")[1]  # type: ignore[union-attr]
            run(["ip", "-n", ns, "addr", "add", f"{host.address}/{prefix}", "dev", host.ifname])
            shaping = plan_link(cfg, host_dev=host.ifname, switch_dev=port)
            for argv in shaping.host_egress:
                run(["tc", "-n", ns, *argv])
            for argv in shaping.switch_egress:
                run(["tc", "-n", sw, *argv])
        hostnames.write_hosts(state.hosts)  # c10d's reverse lookups answer from files


def list_testbeds(*, directory: str | os.PathLike[str] | None = None) -> list[TestbedState]:
    """States of all testbeds with a state file, stale ones included, by name.

    Args:
        directory: where state files live.

    Returns:
        The states; unreadable files are skipped.
    """
    states = []
    for path in sorted(state_dir(directory).glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            states.append(TestbedState.load(path))
    return states


def remove_stale(
    *,
    directory: str | os.PathLike[str] | None = None,
    system: System | None = None,
    orphans_of: str | None = None,
    all_orphans: bool = False,
    locked: bool = False,
) -> list[str]:
    """Remove testbeds of ``directory`` whose owner exited, and, when asked, ``so-*``
    namespaces that no state file there claims.

    A namespace no state file of ``directory`` claims may be a live testbed of another
    state directory (another ``$SCALEOUT_TESTBED_DIR``): so since stop 52 none is removed
    unless asked for (before, every one was by default, and by ``testbed down --all``).

    Args:
        directory: where state files live.
        system: runs ``ip``/``tc``.
        orphans_of: also remove unclaimed namespaces of this testbed name.
        all_orphans: also remove unclaimed namespaces of any name.
        locked: the caller already holds the state directory lock.

    Returns:
        Names of the namespaces removed.

    Raises:
        ValueError: both ``orphans_of`` and ``all_orphans`` are given.
    """
    if orphans_of is not None and all_orphans:
        raise ValueError(f"orphans_of={orphans_of!r} and all_orphans=True: give one of them")
    system = system if system is not None else System()
    directory = state_dir(directory)
    with contextlib.nullcontext() if locked else _lock(directory):
        removed: list[str] = []
        claimed: set[str] = set()
        for state in list_testbeds(directory=directory):
            if state.stale:
                removed += _teardown(state, directory, system)
            else:
                claimed.update(state.namespaces)
        if orphans_of is None and not all_orphans:
            return removed
        for ns in system.namespaces():
            owner = naming.parse_namespace(ns)
            if owner is None or ns in claimed or (orphans_of is not None and owner != orphans_of):
                continue
            system.run(["ip", "netns", "del", ns], check=False)
            hostnames.remove_hosts([ns])
            removed.append(ns)
        return removed


def _teardown(state: TestbedState, directory: Path, system: System) -> list[str]:
    """Delete a testbed's namespaces and state file; returns the namespaces deleted."""
    present = set(system.namespaces())
    removed = []
    for ns in state.namespaces:
        if ns in present:
            system.run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    hostnames.remove_hosts(state.namespaces)
    with contextlib.suppress(FileNotFoundError):
        (directory / f"{state.name}.json").unlink()
    return removed


def _quiet_ipv6(system: System, namespace: str) -> None:
    """Turn IPv6 off in a namespace: no link-local chatter, and gloo cannot pick an
    IPv6 link-local address for ``GLOO_SOCKET_IFNAME``."""
    for scope in ("all", "default"):
        system.write_sysctl(namespace, f"net.ipv6.conf.{scope}.disable_ipv6", "1")


@contextlib.contextmanager
def _lock(directory: Path) -> Iterator[None]:
    """Serialise up/down/cleanup across processes with a lock file in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
