"""scaleout.horovod: objects without pickle, timeline, process sets, launch variables, the
*_built queries."""

from __future__ import annotations

import collections
import json
import os

import pytest
import torch

import scaleout.horovod as hvd
from harness import run_ranks
from scaleout.horovod.launch_vars import horovod_environ, node_key


class Opaque:
    pass


def body_objects() -> list[object]:
    hvd.init(timeout=30)
    r = hvd.rank()
    state = {"epoch": 3 + r, "names": ["a", "b"], "t": torch.arange(3) + r,
             "nested": collections.OrderedDict(x=(1, 2.5, None, True)), "blob": b"\x00\x01"}
    got = hvd.broadcast_object(state, root_rank=hvd.size() - 1)
    every = hvd.allgather_object({"rank": r, "t": torch.ones(r + 1)})
    errors = []
    # only one rank's object cannot travel: every rank raises, none waits for it
    last = hvd.size() - 1
    for fn in (lambda: hvd.broadcast_object(Opaque() if r == last else 1, root_rank=last),
               lambda: hvd.allgather_object(Opaque() if r == last else 1)):
        try:
            fn()
        except TypeError as err:
            errors.append(str(err))
    hvd.shutdown()
    return [got, every, errors]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_objects_travel_without_pickle(n: int) -> None:
    for r, (got, every, errors) in enumerate(run_ranks(n, body_objects, timeout=90)):
        assert got["epoch"] == 3 + n - 1 and torch.equal(got["t"], torch.arange(3) + n - 1)
        assert got["nested"]["x"] == (1, 2.5, None, True) and got["blob"] == b"\x00\x01"
        assert [e["rank"] for e in every] == list(range(n))
        assert [e["t"].numel() for e in every] == [q + 1 for q in range(n)]
        if r == n - 1:
            assert len(errors) == 2 and all("cannot send an object" in e for e in errors)
        else:
            assert errors == [f"broadcast_object: root rank {n - 1} could not send its object "
                              "(see the error there)",
                              f"allgather_object: ranks [{n - 1}] could not send their objects "
                              "(see the errors there)"]


def body_timeline(path: str) -> None:
    hvd.init(timeout=30)
    hvd.start_timeline(path)
    try:
        hvd.start_timeline(path)
    except ValueError as err:
        assert "already recording" in str(err)
    hvd.allreduce(torch.ones(4), name="grad.w")
    hvd.synchronize(hvd.allgather_async(torch.ones(2), name="feature"))
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop does nothing
    hvd.shutdown()


@pytest.mark.parametrize("n", [2, 3])
def test_timeline_is_a_chrome_trace(tmp_path, n: int) -> None:
    path = str(tmp_path / "timeline.json")
    run_ranks(n, body_timeline, path, timeout=90)
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["cat"]) for e in spans} == {
        (r, name, kind) for r in range(n)
        for name, kind in (("grad.w", "allreduce"), ("feature", "allgather"))}
    assert all(e["dur"] >= 0 for e in spans)
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == [f"rank {r}" for r in range(n)]


def body_timeline_env() -> None:
    hvd.init(timeout=30)
    hvd.allreduce(torch.ones(1), name="x")
    hvd.shutdown()  # writes the timeline HOROVOD_TIMELINE named


def test_timeline_from_environment(tmp_path) -> None:
    path = str(tmp_path / "t.json")
    run_ranks(2, body_timeline_env, timeout=90, env={"HOROVOD_TIMELINE": path})
    assert any(e.get("name") == "x" for e in json.load(open(path))["traceEvents"])


def body_process_sets() -> dict[str, object]:
    evens = hvd.ProcessSet([0, 2])
    hvd.init(timeout=30, process_sets=[evens])
    r = hvd.rank()
    odds = hvd.add_process_set([1])
    out: dict[str, object] = {"included": evens.included(), "id": evens.process_set_id}
    if evens.included():
        out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=evens).item()
        out["size"], out["rank"] = evens.size(), evens.rank()
        out["bcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=2, process_set=evens).item()
        out["gather"] = hvd.allgather(torch.tensor([r]), process_set=evens).tolist()
        hvd.barrier(process_set=evens)
    else:
        try:
            hvd.allreduce(torch.ones(1), process_set=evens)
        except ValueError as err:
            out["error"] = str(err)
    if odds.included():
        out["odd_sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=odds).item()
    for bad in (lambda: hvd.add_process_set([0, 2]), lambda: hvd.add_process_set([7]),
                lambda: hvd.remove_process_set(hvd.global_process_set)):
        try:
            bad()
        except ValueError as err:
            out.setdefault("refused", []).append(str(err))
    out["removed"] = hvd.remove_process_set(odds)
    out["removed_again"] = hvd.remove_process_set(odds)
    try:
        hvd.allreduce(torch.ones(1), process_set=odds)
    except ValueError as err:
        out["unregistered"] = str(err)
    # world-level collectives still work
    out["all"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return out


def test_process_sets() -> None:
    got = run_ranks(3, body_process_sets, timeout=120)
    assert got[0]["sum"] == got[2]["sum"] == 2.0 and got[0]["size"] == 2
    assert [got[0]["rank"], got[2]["rank"]] == [0, 1]
    assert got[0]["bcast"] == got[2]["bcast"] == 2.0 and got[0]["gather"] == [0, 2]
    assert "not a member of process set 1" in got[1]["error"] and got[1]["odd_sum"] == 1.0
    for g in got:
        assert len(g["refused"]) == 3 and g["removed"] and not g["removed_again"]
        assert "not registered" in g["unregistered"] and g["all"] == 3.0


def body_process_set_mismatch() -> str:
    hvd.init(timeout=10)
    try:  # rank 2 registers another set than ranks 0 and 1 (each would create its own group)
        hvd.add_process_set([0, 1] if hvd.rank() < 2 else [0, 2])
        return "registered"
    except ValueError as err:
        return str(err)
    finally:
        hvd.shutdown()


def test_process_sets_registered_differently_raise_on_every_rank() -> None:
    got = run_ranks(3, body_process_set_mismatch, timeout=60)
    assert all("rank 2: add_process_set [0, 2]" in text for text in got), got


def body_launch(variables: dict[str, str]) -> tuple[int, int, int]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name)
    os.environ.update(variables)
    hvd.init(timeout=30)
    out = (hvd.rank(), hvd.size(), hvd.local_rank())
    hvd.shutdown()
    return out


def _launch_env(style: str, rank: int, size: int) -> dict[str, str]:
    r, n = str(rank), str(size)
    return {"horovod": {"HOROVOD_RANK": r, "HOROVOD_SIZE": n, "HOROVOD_LOCAL_RANK": r,
                        "HOROVOD_LOCAL_SIZE": n},
            "openmpi": {"OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": n,
                        "OMPI_COMM_WORLD_LOCAL_RANK": r, "OMPI_COMM_WORLD_LOCAL_SIZE": n},
            "mpich": {"PMI_RANK": r, "PMI_SIZE": n, "MPI_LOCALRANKID": r, "MPI_LOCALNRANKS": n},
            "slurm": {"SLURM_PROCID": r, "SLURM_NTASKS": n, "SLURM_LOCALID": r,
                      "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}}[style]


def body_launch_by_style(style: str) -> tuple[int, int, int]:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return body_launch(_launch_env(style, rank, size))


@pytest.mark.parametrize("style", ["horovod", "openmpi", "mpich", "slurm"])
def test_rank_and_size_from_every_launcher(style: str) -> None:
    # MASTER_ADDR/MASTER_PORT come from the harness; the rank/size variables from the style
    assert run_ranks(2, body_launch_by_style, style, timeout=90) == [(0, 2, 0), (1, 2, 1)]


def test_horovod_environ_is_a_pure_mapping() -> None:
    env = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}
    mapped = horovod_environ(env)
    assert (mapped["RANK"], mapped["WORLD_SIZE"], mapped["LOCAL_RANK"]) == ("3", "4", "1")
    assert "RANK" not in env  # the input is not changed
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}
    assert horovod_environ(torchrun) is torchrun
    assert node_key({"GROUP_RANK": "2"}) == 2 and node_key({}, "a") == node_key({}, "a") < 0
    assert node_key({}, "a") != node_key({}, "b")
    with pytest.raises(ValueError, match="SLURM_NODEID must be an integer"):
        node_key({"SLURM_NODEID": "x"})


def test_built_queries() -> None:
    assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_enabled()
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.rocm_built() == (getattr(torch.version, "hip", None) is not None)
    assert isinstance(hvd.nccl_built(), int) and isinstance(hvd.mpi_built(), bool)
    assert not hvd.ddl_built() and not hvd.ccl_built() and not hvd.mpi_threads_supported()


def test_not_initialized_errors() -> None:
    for fn in (hvd.size, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1)),
               lambda: hvd.broadcast_object(1), lambda: hvd.start_timeline("x.json")):
        with pytest.raises(ValueError, match="hvd.init"):
            fn()
    assert not hvd.is_initialized()
    hvd.shutdown()  # shutting down when not running is harmless


def body_attach() -> tuple[float, bool]:
    import scaleout

    env = scaleout.init(timeout=30)
    hvd.init()  # joins the running job
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()  # leaves torch.distributed to its owner
    import torch.distributed as tdist

    alive = tdist.is_initialized()
    env.finalize()
    return total, alive


def test_init_joins_a_job_scaleout_started() -> None:
    assert run_ranks(2, body_attach, timeout=90) == [(2.0, True), (2.0, True)]


@pytest.mark.parametrize("name", ["HOROVOD_GLOO_TIMEOUT_SECONDS", "SCALEOUT_TIMEOUT"])
@pytest.mark.parametrize("text", ["0", "-5", "inf", "nan", "soon"])
def test_a_bad_timeout_variable_is_named(name: str, text: str) -> None:
    from scaleout.horovod.context import _timeout

    with pytest.raises(ValueError, match=f"environment variable {name} must be seconds"):
        _timeout({name: text}, None)
    assert _timeout({name: "30"}, None) == 30.0
