"""Map Horovod's launch variables onto the torchrun convention the core reads.

``horovodrun`` (gloo mode) and Horovod-aware schedulers export ``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK`` ...; torchrun, Open MPI, MPICH and Slurm variables
are read by :func:`scaleout.launch.environment.detect_launch` itself. Both functions here are
pure functions of an environment mapping.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Mapping

__all__ = ["horovod_environ", "node_key"]

# Variables naming this process's node index, most specific first.
_NODE_VARS = ("HOROVOD_CROSS_RANK", "GROUP_RANK", "SLURM_NODEID")


def horovod_environ(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` with ``HOROVOD_*`` launch variables mapped to torchrun's names.

    The mapping applies only when ``HOROVOD_RANK`` and ``HOROVOD_SIZE`` are set and torchrun's
    ``RANK``/``WORLD_SIZE`` are not. The rendezvous stays ``MASTER_ADDR``/``MASTER_PORT``
    (default ``127.0.0.1``: one node): Horovod's own rendezvous server is not used.

    Args:
        environ: the process environment (normally ``os.environ``).

    Returns:
        A mapping :func:`scaleout.init` reads (``environ`` itself when nothing is mapped).

    Example:
        >>> horovod_environ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"})["RANK"]
        '1'
    """
    if "HOROVOD_RANK" not in environ or "HOROVOD_SIZE" not in environ:
        return environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return environ
    mapped = dict(environ)
    mapped["RANK"] = environ["HOROVOD_RANK"]
    mapped["WORLD_SIZE"] = environ["HOROVOD_SIZE"]
    if "HOROVOD_LOCAL_RANK" in environ:
        mapped["LOCAL_RANK"] = environ["HOROVOD_LOCAL_RANK"]
    if "HOROVOD_LOCAL_SIZE" in environ:
        mapped["LOCAL_WORLD_SIZE"] = environ["HOROVOD_LOCAL_SIZE"]
    return mapped


def node_key(environ: Mapping[str, str], hostname: str | None = None) -> int:
    """A number equal on the processes of one node and different across nodes.

    From the launcher's node index when it exports one (``HOROVOD_CROSS_RANK``, torchrun's
    ``GROUP_RANK``, ``SLURM_NODEID``), else a hash of the host name.

    Raises:
        ValueError: a node-index variable is not an integer.
    """
    for name in _NODE_VARS:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError as err:
                raise ValueError(f"environment variable {name} must be an integer, "
                                 f"got {environ[name]!r}") from err
    host = socket.gethostname() if hostname is None else hostname
    # a negative number never collides with a node index
    return -1 - int.from_bytes(hashlib.blake2b(host.encode(), digest_size=6).digest(), "little")
