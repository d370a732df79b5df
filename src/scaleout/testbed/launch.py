"""Place launcher ranks on the hosts of a running testbed."""

from __future__ import annotations

from scaleout.testbed.testbed import Testbed

__all__ = ["attach_wrapper"]


def attach_wrapper(name: str, nprocs: int):
    """For ``scaleout run --testbed NAME``: rank i runs on host ``i % hosts``.

    Returns:
        ``(wrapper, master_addr)``: the launcher's per-rank (argv prefix, environment)
        function and host 0's address.

    Raises:
        ValueError: no testbed of that name is up.
    """
    try:
        testbed = Testbed.attach(name)
    except Exception as err:  # noqa: BLE001 - any failure to attach is a usage error here
        raise ValueError(f"no running testbed named {name!r} ({err}); start one with "
                         f"`scaleout testbed up --name {name} --hosts N --rate 1gbit`") from err
    hosts = testbed.hosts

    def wrapper(local_rank: int) -> tuple[list[str], dict[str, str]]:
        host = hosts[local_rank % len(hosts)]
        return list(host.prefix), dict(host.env())

    return wrapper, testbed.master_addr
