"""Resolvable host names inside a testbed: ``/etc/netns/<namespace>/hosts``.

torch's c10d store client connects to ``MASTER_ADDR`` as an IPv4-mapped IPv6 address
(``::ffff:10.213.0.1``) and, in its log formatting, turns socket addresses into names with
``getnameinfo`` (a reverse lookup). Inside a testbed namespace the machine's DNS server is
unreachable, so the lookup fails with ``EAI_AGAIN`` and c10d printed ``[c10d] The hostname
of the client socket cannot be retrieved. err=-3`` on every rank of every run. An entry in
the global ``/etc/hosts`` does not help: glibc's files backend does not match an IPv4 line
against an IPv4-mapped IPv6 address. ``ip netns exec NS`` bind-mounts each file of
``/etc/netns/NS/`` over ``/etc/`` for the command it runs; so each host gets a hosts file
there: the machine's ``/etc/hosts`` plus every testbed host by its namespace name, as IPv4
and as IPv4-mapped IPv6.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from scaleout.testbed.host import HostInfo

__all__ = ["NETNS_ETC", "hosts_text", "write_hosts", "remove_hosts"]

NETNS_ETC = Path("/etc/netns")


def hosts_text(hosts: Sequence[HostInfo], base: str = "") -> str:
    """The hosts file of a testbed: ``base`` (the machine's) plus each host, both forms."""
    lines = [base.rstrip("\n"), "# scaleout testbed hosts"] if base.strip() else [
        "# scaleout testbed hosts"]
    for host in hosts:
        lines.append(f"{host.address} {host.namespace}")
        lines.append(f"::ffff:{host.address} {host.namespace}")
    return "\n".join(lines) + "\n"


def write_hosts(hosts: Sequence[HostInfo], etc: Path = NETNS_ETC) -> None:
    """Write ``<etc>/<namespace>/hosts`` for every host (atomically, by rename)."""
    try:
        base = Path("/etc/hosts").read_text()
    except OSError:
        base = "127.0.0.1 localhost\n"
    text = hosts_text(hosts, base)
    for host in hosts:
        directory = etc / host.namespace
        directory.mkdir(parents=True, exist_ok=True)
        temp = directory / f".hosts.tmp-{os.getpid()}"
        temp.write_text(text)
        os.replace(temp, directory / "hosts")


def remove_hosts(namespaces: Iterable[str], etc: Path = NETNS_ETC) -> None:
    """Remove ``<etc>/<namespace>/`` of each namespace (missing ones are fine)."""
    for namespace in namespaces:
        shutil.rmtree(etc / namespace, ignore_errors=True)
