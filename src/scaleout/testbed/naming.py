"""Names and addresses of a testbed, chosen not to collide with the machine's own.

All testbed interfaces live inside testbed namespaces (none in the machine's own
namespace), so interface names cannot clash with the host's; namespaces carry the
``so-`` prefix. The subnet is a private ``/24`` that no address or route of the
machine overlaps, and that no other testbed uses.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping

from scaleout.testbed.system import System

__all__ = [
    "PREFIX",
    "HOST_IFNAME",
    "BRIDGE_IFNAME",
    "host_namespace",
    "switch_namespace",
    "switch_port",
    "parse_namespace",
    "host_address",
    "used_networks",
    "choose_subnet",
    "check_subnet_free",
]

PREFIX = "so-"
HOST_IFNAME = "so-eth0"  # not "eth0": a rank started outside its namespace fails to bind
BRIDGE_IFNAME = "br0"
_NAMESPACE_RE = re.compile(r"so-(?P<name>[a-z0-9]{1,12})-(?:sw|h[0-9]+)")
# Candidate /24s, in order: 10.213.0.0/24 ... 10.213.255.0/24, then 172.29.x.0/24.
_CANDIDATE_BLOCKS = ("10.213.0.0/16", "172.29.0.0/16")


def host_namespace(name: str, index: int) -> str:
    """Namespace of host ``index`` of testbed ``name``: ``so-<name>-h<index>``."""
    return f"{PREFIX}{name}-h{index}"


def switch_namespace(name: str) -> str:
    """Namespace of the switch (bridge) of testbed ``name``: ``so-<name>-sw``."""
    return f"{PREFIX}{name}-sw"


def switch_port(index: int) -> str:
    """Interface of host ``index``'s link on the switch: ``h<index>`` (<= 15 chars)."""
    return f"h{index}"


def parse_namespace(namespace: str) -> str | None:
    """The testbed name a namespace belongs to, or ``None`` if it is not a testbed's."""
    match = _NAMESPACE_RE.fullmatch(namespace)
    return match.group("name") if match else None


def host_address(subnet: str, index: int) -> str:
    """Address of host ``index``: the ``index + 1``-th address of ``subnet``."""
    return str(ipaddress.IPv4Network(subnet)[index + 1])


def used_networks(system: System) -> list[ipaddress.IPv4Network]:
    """IPv4 networks this machine's own namespace has addresses or routes in.

    The default route is left out (it overlaps everything by definition).
    """
    networks: list[ipaddress.IPv4Network] = []
    for link in system.json(["ip", "-j", "-4", "addr", "show"]):
        for info in link.get("addr_info", []):
            networks.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in system.json(["ip", "-j", "-4", "route", "show", "table", "all"]):
        dst = route.get("dst", "default")
        if dst == "default":
            continue
        try:
            networks.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:
            continue  # e.g. "broadcast" pseudo-destinations; nothing to avoid
    return networks


def choose_subnet(
    used: Iterable[ipaddress.IPv4Network], taken: Iterable[str] = ()
) -> str:
    """The first candidate private ``/24`` overlapping nothing in ``used`` or ``taken``.

    Args:
        used: networks of the machine (see :func:`used_networks`).
        taken: subnets of other testbeds.

    Returns:
        The subnet, e.g. ``"10.213.0.0/24"``.

    Raises:
        ValueError: every candidate overlaps (pass ``subnet=`` explicitly).
    """
    avoid = [*used, *(ipaddress.IPv4Network(t) for t in taken)]
    for block in _CANDIDATE_BLOCKS:
        for candidate in ipaddress.IPv4Network(block).subnets(new_prefix=24):
            if not any(candidate.overlaps(net) for net in avoid):
                return str(candidate)
    raise ValueError(
        f"subnet: every candidate /24 in {', '.join(_CANDIDATE_BLOCKS)} overlaps a network "
        "in use on this machine; pass an unused private subnet explicitly"
    )


def check_subnet_free(subnet: str, taken: Mapping[str, str]) -> None:
    """Refuse a subnet given explicitly that overlaps another testbed's.

    Args:
        subnet: the subnet asked for, e.g. ``"10.213.0.0/24"``.
        taken: the subnets of the other live testbeds, by testbed name.

    Raises:
        ValueError: naming the testbed whose subnet overlaps, and both subnets.
    """
    wanted = ipaddress.IPv4Network(subnet)
    for name, other in sorted(taken.items()):
        if wanted.overlaps(ipaddress.IPv4Network(other)):
            raise ValueError(
                f"subnet: {subnet} overlaps {other}, the subnet of testbed {name!r}, which is "
                "up: give a subnet that overlaps no other testbed's (see `scaleout testbed "
                "status`), or leave --subnet out to get a free one")
