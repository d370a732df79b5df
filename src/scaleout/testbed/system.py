"""Running ``ip``/``tc`` and checking that this machine can host a testbed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence

from scaleout.testbed.errors import TestbedError, TestbedUnavailable

__all__ = ["System", "check_capabilities"]

_TOOLS = ("ip", "tc")


def check_capabilities() -> None:
    """Check that this process can create network namespaces and shape links.

    Raises:
        TestbedUnavailable: not root, or ``ip``/``tc`` (iproute2) not on ``PATH``;
            the message says which and how to fix it.
    """
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise TestbedUnavailable(
            f"the testbed needs iproute2's {' and '.join(missing)} on PATH "
            f"(apt-get install iproute2); missing: {', '.join(missing)}"
        )
    if os.geteuid() != 0:
        raise TestbedUnavailable(
            "the testbed needs root to create network namespaces "
            f"(running as uid {os.geteuid()}); run with sudo or as root"
        )


class System:
    """Runs ``ip``/``tc`` commands, turning failures into :class:`TestbedError`.

    Args:
        timeout_s: limit for each command, in seconds.
    """

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s}")
        self._timeout_s = timeout_s

    def run(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one command and return its result.

        Args:
            argv: the command, e.g. ``["ip", "netns", "add", "so-tb-h0"]``.
            check: raise if the command exits non-zero.

        Returns:
            The completed process (stdout/stderr as text).

        Raises:
            TestbedError: the command failed (``check``) or timed out; the message
                holds the command line and its stderr.
        """
        try:
            result = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=self._timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise TestbedError(f"`{' '.join(argv)}` timed out after {self._timeout_s:g} s") from err
        except FileNotFoundError as err:
            raise TestbedUnavailable(f"`{argv[0]}` not found on PATH (needed for `{' '.join(argv)}`)") from err
        if check and result.returncode != 0:
            raise TestbedError(
                f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}"
            )
        return result

    def json(self, argv: Sequence[str]) -> list[dict]:
        """Run an ``ip -j ...`` command and parse its JSON output (``[]`` if empty)."""
        out = self.run(argv).stdout.strip()
        return json.loads(out) if out else []

    def namespaces(self) -> list[str]:
        """Names of all network namespaces known to ``ip netns``."""
        return [entry["name"] for entry in self.json(["ip", "-j", "netns", "list"])]

    def in_netns(self, namespace: str, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``namespace`` (``ip netns exec``)."""
        return self.run(["ip", "netns", "exec", namespace, *argv], check=check)

    def write_sysctl(self, namespace: str, key: str, value: str) -> None:
        """Set ``/proc/sys/<key>`` (dotted, e.g. ``net.ipv6.conf.all.disable_ipv6``)
        inside ``namespace`` without needing the ``sysctl`` binary."""
        path = "/proc/sys/" + key.replace(".", "/")
        self.in_netns(namespace, ["sh", "-c", f"echo {value} > {path}"])

    def has_qdisc(self, namespace: str, kind: str, args: Sequence[str] = ()) -> bool:
        """Whether the kernel offers the ``kind`` qdisc, tried on ``lo`` of ``namespace``."""
        added = self.run(
            ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "lo", "root", kind, *args],
            check=False,
        )
        if added.returncode != 0:
            return False
        self.in_netns(namespace, ["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return True
