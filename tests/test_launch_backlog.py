"""Launch-convention defects that were documented but left alone (stop 52): each test failed
before its fix.

- half of a launcher's pair (``OMPI_COMM_WORLD_RANK`` without ``OMPI_COMM_WORLD_SIZE``,
  ``PMI_RANK`` without ``PMI_SIZE``, ``SLURM_PROCID`` without ``SLURM_NTASKS``) made the
  process a job of its own, one rank, without a word;
- a Slurm batch script of several tasks run without ``srun`` (``SLURM_PROCID=0``,
  ``SLURM_NTASKS=N``, no step id) made its one process wait out the rendezvous timeout for
  ranks that never start;
- ``LOCAL_RANK >= LOCAL_WORLD_SIZE`` (and the MPI and Slurm equivalents) was taken, and a
  rank past the world size was refused without naming the variables;
- the command ``scaleout run --testbed`` printed for the other nodes had no ``--testbed``:
  those nodes ran their ranks off the testbed.
"""

from __future__ import annotations

import time

import pytest

from scaleout.launch.environment import detect_launch
from scaleout.launch.launcher import LaunchConfig, node_command


@pytest.mark.parametrize("env,have,lack", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     "OMPI_COMM_WORLD_RANK='1'", "OMPI_COMM_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE='2'", "OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "1", "MPI_LOCALNRANKS": "2"}, "PMI_RANK='1'", "PMI_SIZE"),
    ({"PMI_SIZE": "4"}, "PMI_SIZE='4'", "PMI_RANK"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"}, "SLURM_PROCID='1'",
     "SLURM_NTASKS"),
    ({"SLURM_PROCID": "3"}, "SLURM_PROCID='3'", "SLURM_NTASKS"),
])
def test_half_of_a_launchers_pair_is_refused(env: dict, have: str, lack: str) -> None:
    with pytest.raises(ValueError, match=f"{have} is set but {lack} is not"):
        detect_launch(env)


@pytest.mark.parametrize("env", [
    {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"},  # a salloc shell: an allocation, no launch
    {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"},  # a batch script's one process
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"},  # a batch job of 1 task
])
def test_what_slurm_sets_outside_a_launch_stays_one_process(env: dict) -> None:
    info = detect_launch(env)
    assert (info.rank, info.world_size) == (0, 1)


def test_a_complete_pair_still_wins_over_a_half_one() -> None:
    info = detect_launch({"OMPI_COMM_WORLD_RANK": "1", "PMI_RANK": "1", "PMI_SIZE": "2",
                          "MPI_LOCALNRANKS": "2"})
    assert (info.rank, info.world_size, info.source) == (1, 2, "mpich")


BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
         "SLURM_NODELIST": "cn[07-08]", "SLURM_JOB_NUM_NODES": "2", "ENVIRONMENT": "BATCH"}


@pytest.mark.parametrize("step", [{}, {"SLURM_STEP_ID": "4294967291"},  # Slurm >= 20.11
                                  {"SLURM_STEPID": "4294967294"},  # the batch step before
                                  {"SLURM_STEP_ID": "batch"}])
def test_a_batch_script_without_srun_is_refused_at_once(step: dict) -> None:
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=4 come from the Slurm batch script.*"
                                         r"3 ranks that never start.*srun"):
        detect_launch({**BATCH, **step})


def test_a_task_srun_started_is_a_rank() -> None:
    step = {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "cn[07-08]", "SLURM_STEP_NUM_NODES": "2"}
    info = detect_launch({**BATCH, **step})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (
        3, 4, 1, "cn07", "slurm")


def test_init_in_a_batch_script_fails_before_any_rendezvous() -> None:
    """The whole path: ``scaleout.init`` under the batch step's variables raises the usage
    error at once; before, it waited out its timeout for ranks 1-3."""
    import scaleout

    began = time.monotonic()
    with pytest.raises(ValueError, match="Start the ranks with srun"):
        scaleout.init(timeout=3, environ={**BATCH, "MASTER_ADDR": "127.0.0.1",
                                          "MASTER_PORT": "1"})
    assert time.monotonic() - began < 2


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_RANK=4 must be less than LOCAL_WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "9", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_RANK=9 must be less than LOCAL_WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE=4 is more than WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 must be >= 1"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "OMPI_COMM_WORLD_LOCAL_RANK=2 must be less than OMPI_COMM_WORLD_LOCAL_SIZE=2"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "3", "MPI_LOCALNRANKS": "2"},
     "PMI_LOCAL_RANK=3 must be less than MPI_LOCALNRANKS=2"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "2", "SLURM_NNODES": "1"},
     "SLURM_LOCALID=2 must be less than SLURM_NTASKS=2"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be less than WORLD_SIZE=2"),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"},
     "OMPI_COMM_WORLD_RANK=5 must be less than OMPI_COMM_WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK must be an integer"),
])
def test_a_rank_outside_its_size_names_both_variables(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch(env)


def test_the_other_nodes_command_keeps_the_testbed() -> None:
    config = LaunchConfig(nprocs=1, nnodes=2, master_addr="10.213.0.1", master_port=29511,
                          env={"SCALEOUT_JOB_TOKEN": "secret"}, testbed="tb7")
    assert node_command(["train.py"], config, 1) == (
        "scaleout run -n 1 --nnodes 2 --node-rank 1 --master-addr 10.213.0.1 --master-port "
        "29511 --testbed tb7 train.py")
    assert "--testbed" not in node_command(["train.py"], LaunchConfig(
        nprocs=1, nnodes=2, master_port=29511, env={"SCALEOUT_JOB_TOKEN": "secret"}), 1)
    with pytest.raises(ValueError, match="testbed must be a testbed's name or None, got ''"):
        LaunchConfig(nprocs=1, testbed="")
