"""Detect how this process was launched: torchrun, Open MPI, MPICH/Intel MPI, Slurm or alone.

The result is a plain :class:`LaunchInfo`; :func:`detect_launch` is a pure function of an
environment mapping so that every launcher convention can be tested without launching.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = ["LaunchInfo", "TESTBED_HOST_VAR", "detect_launch", "first_host", "machine",
           "proc_stat"]

DEFAULT_PORT = 29500
#: Set by the testbed on each of its hosts (``HostInfo.env``): this process runs on an
#: emulated machine of its own, whatever the launcher that started it counts as local.
TESTBED_HOST_VAR = "SCALEOUT_TESTBED_HOST"
#: each launcher's rank and world-size variables, in order of precedence
_LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE"),
              ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("mpich", "PMI_RANK", "PMI_SIZE"),
              ("slurm", "SLURM_PROCID", "SLURM_NTASKS"))
#: who sets each pair, for the message that one of them is missing
_SETS_BOTH = {"torchrun": "as torchrun and scaleout run do", "openmpi": "as Open MPI's mpirun does",
              "mpich": "as MPICH's and Intel MPI's mpiexec do", "slurm": "as srun does"}
#: each launcher's local-rank variables, the first that is set is read
_LOCAL_RANK_VARS = {"torchrun": ("LOCAL_RANK",),
                    "openmpi": ("OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK"),
                    "mpich": ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), "slurm": ("SLURM_LOCALID",)}
_LOCAL_SIZE_VARS = {"torchrun": "LOCAL_WORLD_SIZE", "openmpi": "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "mpich": "MPI_LOCALNRANKS"}
#: Slurm's own steps (batch script, extern, interactive, pending) have ids from here up
_FIRST_OWN_STEP = 0xFFFFFFF0


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """Who this process is and where the rendezvous is.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank among the processes of this node.
        master_addr: address of the rendezvous (rank 0's host).
        master_port: TCP port of the rendezvous.
        source: which convention supplied the values ("torchrun", "openmpi", "mpich", "slurm",
            "single").
        local_world_size: how many of the ranks the launcher started on this machine
            (torchrun's and ``scaleout run``'s ``LOCAL_WORLD_SIZE``, Open MPI's
            ``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS``, a one-node Slurm
            step's tasks); ``None`` where it does not say.
        testbed_host: the process runs on a testbed host (:data:`TESTBED_HOST_VAR`): an
            emulated machine of its own behind its own shaped link.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    local_world_size: int | None = None
    testbed_host: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, {self.world_size}), got {self.rank} (from {self.source})"
            )
        if self.local_rank < 0:
            raise ValueError(f"local rank must be >= 0, got {self.local_rank} (from {self.source})")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master port must be in 1..65535, got {self.master_port}")

    @property
    def loopback(self) -> bool:
        """Whether the rendezvous is on a loopback address: every rank on this one machine,
        their traffic through the kernel's loopback (memory copies, not a network)."""
        return self.master_addr in ("localhost", "::1") or self.master_addr.startswith("127.")

    @property
    def one_machine(self) -> bool:
        """Whether every rank runs on this one machine, so that their traffic is the kernel's
        memory copies with no link between them: the rendezvous is on a loopback address, or
        the launcher puts all ``world_size`` ranks on this node (a single-node Slurm or MPI
        job rendezvouses on the node's host name), and they are not testbed hosts (which
        ``scaleout run`` starts as local ranks of this machine). Every rank of a job reads
        the same answer. Not a question of security: a host-name rendezvous is reachable
        from elsewhere (:attr:`loopback`)."""
        return self.loopback or (not self.testbed_host
                                 and self.local_world_size == self.world_size)


def _local_size(environ: Mapping[str, str], source: str) -> tuple[int | None, str]:
    """How many ranks the launcher ``source`` started on this node (:class:`LaunchInfo`'s
    ``local_world_size``), or ``None`` where it does not say, and the variable that says it.
    Unlike :func:`scaleout.core.backend.local_world_size` (GPUs to share: any launcher's
    variable, at least this rank's), it reads only the launcher's own variable and Slurm's
    node count.

    Raises:
        ValueError: the variable is not an integer.
    """
    if source == "single":
        return 1, ""
    if source == "slurm":
        nodes = next((environ[var] for var in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES",
                                                "SLURM_NNODES") if var in environ), None)
        return (_int(environ, "SLURM_NTASKS") if nodes == "1" else None), "SLURM_NTASKS"
    var = _LOCAL_SIZE_VARS.get(source, "")
    return (_int(environ, var) if var in environ else None), var


def _int(environ: Mapping[str, str], name: str) -> int:
    """``name``'s value as a whole number >= 0, digits only (Python's ``int`` also read
    ``"1_0"`` as 10, and ``" 3"``; since stop 51 they are refused)."""
    value = environ[name]
    if re.fullmatch(r"[0-9]+", value) is None:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r} "
                         "(digits only)")
    return int(value)


def first_host(nodelist: str) -> str:
    """The first host name of a Slurm node list such as ``node[03-05,07],gpu1``, also with
    text after a range (``node[1-4]-ib``: ``node1-ib``) or several ranges
    (``rack[1-2]-node[01-04]``: ``rack1-node01``).

    Raises:
        ValueError: for an empty list, or one that does not start with a host name.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty Slurm node list")
    # the first entry: up to the first comma outside brackets
    match = re.match(r"[^,\[\]]+(?:\[[^\]]*\][^,\[\]]*)*", nodelist)
    if match is None:  # it starts with "," or "["
        raise ValueError(f"a Slurm node list must start with a host name, got {nodelist!r}")
    if nodelist[match.end():match.end() + 1] not in ("", ","):  # a "[" left open
        raise ValueError(f"a Slurm node list's brackets must pair up, got {nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda ranges: ranges.group(1).split(",")[0].split("-")[0],
                  match.group(0))


def _rendezvous(environ: Mapping[str, str], default_addr: str) -> tuple[str, int]:
    addr = environ.get("MASTER_ADDR", default_addr)
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_PORT
    return addr, port


def detect_launch(environ: Mapping[str, str]) -> LaunchInfo:
    """Read the launch convention from ``environ`` (normally ``os.environ``).

    Precedence: torchrun variables (``RANK``/``WORLD_SIZE``), then Open MPI
    (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``), Slurm
    (``SLURM_PROCID``/``SLURM_NTASKS``), else a single process. Under MPI and Slurm the
    rendezvous address comes from ``MASTER_ADDR`` if set, else rank 0's host when it can be
    known (the first node of a Slurm allocation) or ``127.0.0.1`` when every rank is local.

    Returns:
        The detected :class:`LaunchInfo`.

    Raises:
        ValueError: a variable is malformed; only one of a launcher's rank and size
            variables is set (``RANK``/``WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``/``_SIZE``,
            ``PMI_RANK``/``PMI_SIZE``, ``SLURM_PROCID`` without ``SLURM_NTASKS``) and no
            other launcher's pair is; a rank is not below its size (``RANK``/``WORLD_SIZE``,
            the local rank/``LOCAL_WORLD_SIZE``) or more ranks are local than in the job; a
            Slurm batch script of several tasks runs without ``srun``; or a multi-node MPI
            job has no ``MASTER_ADDR``.

    Example:
        >>> detect_launch({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0",
        ...                "MASTER_PORT": "1234"}).rank
        1
    """
    info = _detect(environ)
    local_size, size_var = _local_size(environ, info.source)
    info = replace(info, local_world_size=local_size, testbed_host=TESTBED_HOST_VAR in environ)
    _check_local(environ, info, size_var)
    return info


def _detect(environ: Mapping[str, str]) -> LaunchInfo:
    """:func:`detect_launch` before the local size and the testbed flag."""
    for source, rank_var, size_var in _LAUNCHERS:
        if rank_var in environ and size_var in environ:
            rank, size = _rank_and_size(environ, rank_var, size_var)
            if source == "slurm":
                return _slurm(environ, rank, size)
            addr = "127.0.0.1"
            if source != "torchrun":
                all_local = size == 1 or _local_size(environ, source)[0] == size
                if "MASTER_ADDR" not in environ and not all_local:
                    raise ValueError(
                        f"launched by {source} across several nodes but MASTER_ADDR is not "
                        "set: export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) in the "
                        "job script")
            addr, port = _rendezvous(environ, addr)
            local = _local_rank_var(environ, source)
            return LaunchInfo(rank=rank, world_size=size,
                              local_rank=_int(environ, local) if local else 0,
                              master_addr=addr, master_port=port, source=source)
    _refuse_a_partial_set(environ)
    return LaunchInfo(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=DEFAULT_PORT,
        source="single",
    )


def _rank_and_size(environ: Mapping[str, str], rank_var: str, size_var: str) -> tuple[int, int]:
    """The launcher's rank and world size, checked against each other with their names
    (since stop 52; before, ``LaunchInfo`` refused them without naming the variables)."""
    rank, size = _int(environ, rank_var), _int(environ, size_var)
    if size < 1:
        raise ValueError(f"environment variable {size_var}={size} must be >= 1 (the number of "
                         "processes in the job)")
    if rank >= size:
        raise ValueError(f"environment variable {rank_var}={rank} must be less than "
                         f"{size_var}={size} (rank must be in [0, {size}))")
    return rank, size


def _local_rank_var(environ: Mapping[str, str], source: str) -> str | None:
    """The variable the local rank is read from (the first of the launcher's that is set)."""
    return next((var for var in _LOCAL_RANK_VARS.get(source, ()) if var in environ), None)


def _refuse_a_partial_set(environ: Mapping[str, str]) -> None:
    """Refuse half of a launcher's pair (no launcher's pair is complete): a lost variable
    would otherwise make this rank a job of its own. Slurm's ``SLURM_NTASKS`` alone is an
    allocation (a ``salloc`` shell), not a launch; ``SLURM_PROCID`` alone in a batch script
    is its one process (since stop 52; before, only ``RANK``/``WORLD_SIZE`` were checked).

    Raises:
        ValueError: naming the variable set and the one missing.
    """
    for source, rank_var, size_var in _LAUNCHERS:
        have = [var for var in (rank_var, size_var) if var in environ]
        if source == "slurm" and (rank_var not in have or _batch_step(environ) is not None):
            continue
        if have:
            lack = size_var if have[0] == rank_var else rank_var
            raise ValueError(
                f"environment variable {have[0]}={environ[have[0]]!r} is set but {lack} is "
                f"not: set both {rank_var} and {size_var} ({_SETS_BOTH[source]}), or "
                "neither for a single process")


def _batch_step(environ: Mapping[str, str]) -> str | None:
    """Why this process is a Slurm job's batch script (or another step of Slurm's own), not
    a task that ``srun`` started; ``None`` when it is a task, or when no Slurm job is said.

    ``srun`` sets ``SLURM_STEP_ID`` (and the older ``SLURM_STEPID``) in every task it starts;
    the batch step does not (its id, 0xfffffffb, or 0xfffffffe before Slurm 20.11, is one of
    Slurm's own above :data:`_FIRST_OWN_STEP`, which ``slurmstepd`` does not export), though
    it sets ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` (the tasks the job may start).
    """
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step is None:
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        return f"SLURM_JOB_ID={job} is set but SLURM_STEP_ID is not" if job else None
    if re.fullmatch(r"[0-9]+", step) and int(step) < _FIRST_OWN_STEP:
        return None
    return f"SLURM_STEP_ID={step!r} is one of Slurm's own steps"


def _slurm(environ: Mapping[str, str], rank: int, size: int) -> LaunchInfo:
    """The launch of a task of a Slurm step.

    Raises:
        ValueError: a batch script of a job of several tasks, run without ``srun``; a
            malformed node list.
    """
    outside = _batch_step(environ)
    if outside is not None and size > 1:  # since stop 52; before, it waited out the timeout
        raise ValueError(
            f"SLURM_PROCID={rank} and SLURM_NTASKS={size} come from the Slurm batch script, "
            f"not from a task srun started ({outside}): this one process would wait for "
            f"{size - 1} ranks that never start. Start the ranks with srun in the batch "
            "script (srun python train.py), or start them with scaleout run; for a single "
            "process, export RANK=0 WORLD_SIZE=1")
    name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_NODELIST"
    nodelist = environ.get(name, "")
    try:
        default_addr = first_host(nodelist) if nodelist else "127.0.0.1"
    except ValueError as err:
        raise ValueError(f"environment variable {name} must be a Slurm node list "
                         f"(like node[03-05,07]), got {nodelist!r}") from err
    addr, port = _rendezvous(environ, default_addr)
    return LaunchInfo(
        rank=rank, world_size=size,
        local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
        master_addr=addr, master_port=port, source="slurm",
    )


def _check_local(environ: Mapping[str, str], info: LaunchInfo, size_var: str) -> None:
    """Refuse a local rank outside this node's ranks, or more ranks on this node than in
    the job, naming the variables (since stop 52; before, ``LOCAL_RANK=4`` with
    ``LOCAL_WORLD_SIZE=4`` was taken).

    Raises:
        ValueError: naming both variables and their values.
    """
    local_size = info.local_world_size
    if local_size is None or info.source == "single":
        return
    world_var = next(size for source, _, size in _LAUNCHERS if source == info.source)
    local_var = _local_rank_var(environ, info.source)
    if local_size < 1:
        raise ValueError(f"environment variable {size_var}={local_size} must be >= 1 (the "
                         "ranks on this node)")
    if local_size > info.world_size:
        raise ValueError(f"environment variable {size_var}={local_size} is more than "
                         f"{world_var}={info.world_size}: a node cannot run more ranks than "
                         "the job has")
    if local_var is not None and info.local_rank >= local_size:
        raise ValueError(f"environment variable {local_var}={info.local_rank} must be less "
                         f"than {size_var}={local_size} (the ranks on this node are "
                         f"0..{local_size - 1})")


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first), or None
    when the process is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def machine() -> str:
    """This process's kernel and pid namespace: processes with the same value can see each
    other's pids (in ``/proc``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip() + "/" + os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
