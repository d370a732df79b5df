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
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "master port"),
])
def test_malformed(env: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        detect_launch(env)
    assert fragment in str(info.value)
