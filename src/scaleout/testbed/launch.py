"""Place launcher ranks on the hosts of a running testbed: one rank per host."""

from __future__ import annotations

from scaleout.testbed.testbed import Testbed

__all__ = ["attach_wrapper"]


def attach_wrapper(name: str, nprocs: int, *, nnodes: int = 1, node_rank: int = 0):
    """For ``scaleout run --testbed NAME``: rank i runs on host i, one rank per host.

    With ``--nnodes``, each launcher places its local ranks on the hosts of their global
    ranks (``node_rank * nprocs + local_rank``), so two launchers never share a host.

    Ranks sharing a host would share its one shaped link and measure nothing a cluster of
    that many hosts would see, so more ranks than hosts is refused.

    Returns:
        ``(wrapper, master_addr)``: the launcher's per-rank (argv prefix, environment)
        function and host 0's address.

    Raises:
        ValueError: no testbed of that name is up, or it has fewer hosts than ranks
            (``nprocs * nnodes``).
    """
    try:
        testbed = Testbed.attach(name)
    except Exception as err:  # noqa: BLE001 - any failure to attach is a usage error here
        raise ValueError(f"no running testbed named {name!r} ({err}); start one with "
                         f"`scaleout testbed up --name {name} --hosts N --rate 1gbit`") from err
    hosts = testbed.hosts
    ranks = nprocs * nnodes
    if ranks > len(hosts):
        give = (f"give -n {len(hosts)} or fewer" if nnodes == 1 else
                f"-n {nprocs} on each of --nnodes {nnodes} is {ranks} ranks: give -n x --nnodes "
                f"of {len(hosts)} or fewer")
        raise ValueError(f"testbed {name!r} has {len(hosts)} hosts and runs one rank per host: "
                         f"{give}, or bring up a testbed with --hosts {ranks}")

    def wrapper(local_rank: int) -> tuple[list[str], dict[str, str]]:
        host = hosts[node_rank * nprocs + local_rank]
        return list(host.prefix), dict(host.env())

    return wrapper, testbed.master_addr
