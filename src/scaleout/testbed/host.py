"""One emulated host, as a launcher sees it: :class:`HostInfo`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scaleout.launch.environment import TESTBED_HOST_VAR

__all__ = ["HostInfo"]


@dataclass(frozen=True, kw_only=True)
class HostInfo:
    """Host ``index`` of a testbed: where to run a rank and how to bind gloo.

    Attributes:
        index: 0-based host number (host 0 holds the rendezvous, ``MASTER_ADDR``).
        namespace: the host's network namespace, e.g. ``so-tb-h0``.
        ifname: the host's interface inside its namespace (``so-eth0``).
        address: the host's IPv4 address on the testbed network.
        master_addr: host 0's address.

    Example:
        >>> h = HostInfo(index=1, namespace="so-tb-h1", ifname="so-eth0",
        ...              address="10.213.0.2", master_addr="10.213.0.1")
        >>> h.command(["python", "train.py"])
        ['ip', 'netns', 'exec', 'so-tb-h1', 'python', 'train.py']
        >>> h.env(master_port=29500)["GLOO_SOCKET_IFNAME"]
        'so-eth0'
    """

    index: int
    namespace: str
    ifname: str
    address: str
    master_addr: str

    @property
    def prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.namespace]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host.

        Args:
            argv: the command, e.g. ``[sys.executable, "-m", "worker"]``.

        Returns:
            ``["ip", "netns", "exec", namespace, *argv]``.
        """
        return [*self.prefix, *argv]

    def env(self, *, master_port: int | None = None) -> dict[str, str]:
        """Environment variables a rank on this host needs (merge into ``os.environ``).

        Args:
            master_port: the rendezvous port on host 0, if known; sets ``MASTER_PORT``.

        Returns:
            ``GLOO_SOCKET_IFNAME`` (gloo binds this host's testbed interface),
            ``MASTER_ADDR`` (host 0's address), ``SCALEOUT_TESTBED_HOST`` (this host's index:
            a rank here is on a machine of its own, though the launcher that started it
            counts every rank as local) and optionally ``MASTER_PORT``.
        """
        env = {"GLOO_SOCKET_IFNAME": self.ifname, "MASTER_ADDR": self.master_addr,
               TESTBED_HOST_VAR: str(self.index)}
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        return env

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the fields."""
        return {
            "index": self.index,
            "namespace": self.namespace,
            "ifname": self.ifname,
            "address": self.address,
            "master_addr": self.master_addr,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> HostInfo:
        """Inverse of :meth:`to_dict`."""
        return cls(
            index=int(data["index"]),  # type: ignore[arg-type]
            namespace=str(data["namespace"]),
            ifname=str(data["ifname"]),
            address=str(data["address"]),
            master_addr=str(data["master_addr"]),
        )
