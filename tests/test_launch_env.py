"""Launch conventions: torchrun, Open MPI, MPICH / Intel MPI, Slurm, single process."""

import pytest

from scaleout.launch.environment import detect_launch, first_host


def test_torchrun() -> None:
    info = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                          "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port,
            info.source) == (3, 4, 1, "10.0.0.1", 1234, "torchrun")


def test_open_mpi_local() -> None:
    info = detect_launch({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (
        1, 2, 1, "127.0.0.1", "openmpi")


def test_mpi_across_nodes_needs_master_addr() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        detect_launch(env)
    info = detect_launch({**env, "MASTER_ADDR": "node0", "MASTER_PORT": "4000"})
    assert (info.world_size, info.master_addr, info.master_port, info.source) == (
        8, "node0", 4000, "mpich")


def test_slurm_uses_first_node() -> None:
    info = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                          "SLURM_NODELIST": "cn[07-08,11]"})
    assert (info.rank, info.local_rank, info.master_addr, info.source) == (5, 1, "cn07", "slurm")


@pytest.mark.parametrize("nodelist,host", [("a1", "a1"), ("gpu[3-4]", "gpu3"),
                                           ("n[001,005]", "n001"), ("x,y", "x")])
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_single_process_fallback() -> None:
    info = detect_launch({})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


@pytest.mark.parametrize("env,fragment", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in [0, 2)"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer"),
    ({"RANK": "1_0", "WORLD_SIZE": "11"}, "RANK must be an integer, got '1_0'"),  # (int() took
    ({"RANK": "0", "WORLD_SIZE": " 2"}, "WORLD_SIZE must be an integer, got ' 2'"),  # these)
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "master port"),
    ({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "abc"},
     "MPI_LOCALRANKID must be an integer, got 'abc'"),
    ({"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_LOCAL_RANK": "x"},
     "PMI_LOCAL_RANK must be an integer, got 'x'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "[1-2]"},
     "SLURM_STEP_NODELIST must be a Slurm node list (like node[03-05,07]), got '[1-2]'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": ",a"},
     "SLURM_NODELIST must be a Slurm node list"),
    ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "WORLD_SIZE='2' is set but RANK is not"),
])
def test_malformed(env: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        detect_launch(env)
    assert fragment in str(info.value)


def test_a_lone_rank_variable_defers_to_another_launcher() -> None:
    # RANK without WORLD_SIZE is an error only when nothing else says who this process is
    info = detect_launch({"RANK": "7", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (info.rank, info.world_size, info.source) == (1, 2, "openmpi")
    info = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1",
                          "MPI_LOCALNRANKS": "2"})
    assert (info.local_rank, info.source) == (1, "mpich")


def test_first_host_rejects_a_list_without_a_host() -> None:
    with pytest.raises(ValueError, match=r"must start with a host name, got '\[1-2\]'"):
        first_host("[1-2]")


@pytest.mark.parametrize("env,one_machine", [
    # torchrun / scaleout run: every rank of the job on this node, or not
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0"}, True),
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0"}, False),
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "node0"}, False),  # not said
    ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}, True),  # loopback
    # a testbed host is a machine of its own, whatever the launcher counts as local
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.213.0.1",
      "SCALEOUT_TESTBED_HOST": "0"}, False),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "SCALEOUT_TESTBED_HOST": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.213.0.1"}, False),
    # a single-node MPI job whose script exports the node's name
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}, True),
    ({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "node0"}, False),
    # Slurm meets on the first node's name: one node, or several
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "cn07",
      "SLURM_JOB_NUM_NODES": "1"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "cn[07-08]",
      "SLURM_JOB_NUM_NODES": "2"}, False),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NODELIST": "cn[07-08]",
      "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "1"}, True),  # a step on one
    ({}, True),  # a single process
])
def test_one_machine_is_read_from_the_launcher(env: dict, one_machine: bool) -> None:
    """``one_machine`` (an open policy is fifo, lookups go dense, the tuner picks nothing
    lossy): a loopback rendezvous, or every rank on this node as the launcher says."""
    info = detect_launch(env)
    assert info.one_machine is one_machine, (env, info)
    assert info.loopback is (info.master_addr.startswith("127.") or info.master_addr == "localhost")


def test_a_malformed_local_size_is_named() -> None:
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer, got 'x'"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x"})


def test_an_attached_job_reads_its_launch_as_init_does() -> None:
    """``scaleout.core.env.attach`` (torch.distributed initialised by the user, e.g. under
    mpirun) reads the launcher's variables as ``init`` does where they describe a job of the
    group's size (torch.distributed's rank); else only the torchrun-style ones."""
    from scaleout.core.env import attached_launch

    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "4000"}
    info = attached_launch(mpi, 1, 2)
    assert (info.rank, info.local_rank, info.local_world_size, info.master_addr,
            info.source, info.one_machine) == (1, 1, 2, "node0", "attached (openmpi)", True)
    other = attached_launch(mpi, 3, 4)  # another job's variables
    assert (other.rank, other.world_size, other.local_rank, other.local_world_size,
            other.master_addr, other.source) == (3, 4, 0, None, "node0", "attached")
    bad = attached_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x",
                           "SCALEOUT_TESTBED_HOST": "0"}, 0, 2)
    assert (bad.source, bad.testbed_host, bad.one_machine) == ("attached", True, True)


def test_attach_refuses_a_check_mode_at_once() -> None:
    """Before stop 49 ``attach(check_consistency="bogus")`` was taken, and refused only by
    ``create_distribution``; now at the call, before it looks at torch.distributed."""
    from scaleout.core.env import attach

    with pytest.raises(ValueError, match="check_consistency .* must be one of .*'bogus'"):
        attach(check_consistency="bogus")
