"""Place launcher ranks on the hosts of a running testbed: one rank per host."""

from __future__ import annotations

from scaleout.testbed.testbed import Testbed

__all__ = ["attach_wrapper"]


def attach_wrapper(name: str, nprocs: int):
    """For ``scaleout run --testbed NAME``: rank i runs on host i, one rank per host.

    Ranks sharing a host would share its one shaped link and measure nothing a cluster of
    that many hosts would see, so more ranks than hosts is refused.

    Returns:
        ``(wrapper, master_addr)``: the launcher's per-rank (argv prefix, environment)
        function and host 0's address.

    Raises:
        ValueError: no testbed of that name is up, or it has fewer hosts than ``nprocs``.
    """
    try:
        testbed = Testbed.attach(name)
    except Exception as err:  # noqa: BLE001 - any failure to attach is a usage error here
        raise ValueError(f"no running testbed named {name!r} ({err}); start one with "
                         f"`scaleout testbed up --name {name} --hosts N --rate 1gbit`") from err
    hosts = testbed.hosts
    if nprocs > len(hosts):
        raise ValueError(f"testbed {name!r} has {len(hosts)} hosts and runs one rank per host: "
                         f"give -n {len(hosts)} or fewer, or bring up a testbed with "
                         f"--hosts {nprocs}")

    def wrapper(local_rank: int) -> tuple[list[str], dict[str, str]]:
        host = hosts[local_rank]
        return list(host.prefix), dict(host.env())

    return wrapper, testbed.master_addr
