"""The backend choice of ``scaleout.init`` as a pure function: automatic, overridable, and an
impossible choice is a ValueError before any rendezvous."""

from __future__ import annotations

import pytest
import torch

import scaleout
from harness import cuda_available, run_ranks
from scaleout.core.backend import _choose_backend, local_world_size

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("gpus, local, rank, expected", [
    (0, 1, 0, ("gloo", CPU)),                       # no CUDA
    (0, 4, 3, ("gloo", CPU)),
    (1, 1, 0, ("cpu:gloo,cuda:nccl", GPU0)),        # one process per GPU: NCCL for CUDA
    (2, 2, 1, ("cpu:gloo,cuda:nccl", GPU1)),
    (8, 2, 1, ("cpu:gloo,cuda:nccl", GPU1)),
    (1, 2, 1, ("gloo", GPU0)),                      # two ranks share one GPU: gloo, CUDA tensors
    (2, 3, 2, ("gloo", GPU0)),
])
def test_automatic_choice(gpus: int, local: int, rank: int, expected: tuple) -> None:
    assert _choose_backend(None, cuda_devices=gpus, local_world_size=local, local_rank=rank) == expected


def test_explicit_backend_and_environment_override() -> None:
    assert _choose_backend("gloo", cuda_devices=1, local_world_size=1) == ("gloo", GPU0)
    env = {"SCALEOUT_BACKEND": "gloo"}
    assert _choose_backend(None, cuda_devices=1, local_world_size=1, environ=env)[0] == "gloo"
    # the argument wins over the variable
    assert _choose_backend("cpu:gloo,cuda:nccl", cuda_devices=1, local_world_size=1,
                           environ=env)[0] == "cpu:gloo,cuda:nccl"
    assert _choose_backend(None, cuda_devices=0, local_world_size=1,
                           environ={"SCALEOUT_BACKEND": " "})[0] == "gloo"


@pytest.mark.parametrize("backend, gpus, local, message", [
    ("nccl", 0, 1, "sees no GPU"),
    ("cpu:gloo,cuda:nccl", 0, 1, "sees no GPU"),
    ("nccl", 1, 2, "2 processes on this node share 1 GPU"),
    ("cpu:gloo,cuda:nccl", 2, 4, "4 processes on this node share 2 GPU"),
    ("ucc", 1, 1, "unknown backend"),
])
def test_impossible_choices_are_value_errors(backend: str, gpus: int, local: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _choose_backend(backend, cuda_devices=gpus, local_world_size=local)


def test_environment_variable_is_validated_and_named() -> None:
    with pytest.raises(ValueError, match="SCALEOUT_BACKEND"):
        _choose_backend(None, cuda_devices=0, local_world_size=1, environ={"SCALEOUT_BACKEND": "nccl"})
    with pytest.raises(TypeError):
        _choose_backend(3, cuda_devices=0, local_world_size=1)  # type: ignore[arg-type]


def test_local_world_size_from_launchers() -> None:
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}, 0) == 4
    assert local_world_size({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 1) == 3
    assert local_world_size({"MPI_LOCALNRANKS": "2"}, 0) == 2
    assert local_world_size({}, 2) == 3  # unknown: at least this rank and those below it


def test_init_refuses_nccl_before_any_rendezvous() -> None:
    """No GPU here (or hidden): init raises at once instead of waiting for peers."""
    if cuda_available():
        pytest.skip("this machine has CUDA; the no-GPU error cannot happen")
    environ = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match="NCCL"):
        scaleout.init(backend="nccl", timeout=1, environ=environ)


def _describe() -> tuple[str, str, str, bool]:
    env = scaleout.init(timeout=20)
    described = (env.backend, str(env.device), repr(env), torch.cuda.is_available())
    env.finalize()
    return described


def test_environment_exposes_backend_and_device() -> None:
    """In forked ranks (CUDA, if any, is initialised there, never in this process)."""
    for world_size in (1, 2):
        for backend, device, text, cuda in run_ranks(world_size, _describe, timeout=60):
            if not cuda:
                assert (backend, device) == ("gloo", "cpu")
            elif world_size == 1:  # one GPU per process
                assert (backend, device) == ("cpu:gloo,cuda:nccl", "cuda:0")
            assert f"device={device}" in text


def test_choose_backend_reads_the_launcher() -> None:
    from scaleout.core.env import choose_backend

    if cuda_available():
        pytest.skip("the answer depends on this machine's GPUs")
    assert choose_backend(environ={"LOCAL_WORLD_SIZE": "2"}, local_rank=1) == ("gloo", CPU)
    with pytest.raises(ValueError, match="SCALEOUT_BACKEND"):
        choose_backend(environ={"SCALEOUT_BACKEND": "nccl"})
