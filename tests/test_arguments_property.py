"""Property-based checks of the public API's argument checking: any input is either accepted
or rejected with ValueError/TypeError, never another exception or a hang."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaleout
from scaleout import GroupType, ReduceOp
from scaleout.core import Grid
from scaleout.compression import CompressionConfig, make_codec
from scaleout.compression.registry import CODECS
from scaleout.scheduler import SchedulerConfig

SETTINGS = settings(max_examples=150, deadline=5000,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

# Anything a user might pass where a number, a name or a count is expected.
anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=4), st.lists(st.integers(-3, 8), max_size=4),
    st.timedeltas(min_value=timedelta(days=-3), max_value=timedelta(days=3)),
)
small_ints = st.one_of(st.integers(-3, 12), anything)


def accepted_or_refused(call: Callable[[], Any]) -> Any:
    """Run ``call``; a ValueError or TypeError is a fine answer, anything else fails."""
    try:
        return call()
    except (ValueError, TypeError) as err:
        assert str(err), "an error must say what was expected and what was received"
        return err


@SETTINGS
@given(timeout=anything)
def test_init_timeout(timeout: object) -> None:
    result = accepted_or_refused(lambda: scaleout.init(timeout=timeout, environ={}))
    if isinstance(result, scaleout.Environment):
        result.finalize()


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -1, 0, "x", 1e300])
def test_init_timeout_examples_from_the_issue(timeout: object) -> None:
    with pytest.raises((ValueError, TypeError), match="timeout must be"):
        scaleout.init(timeout=timeout, environ={})


@SETTINGS
@given(world_size=small_ints, data_parts=small_ints, model_parts=small_ints)
def test_grid(world_size: object, data_parts: object, model_parts: object) -> None:
    grid = accepted_or_refused(lambda: Grid(world_size=world_size, data_parts=data_parts,
                                            model_parts=model_parts))
    if isinstance(grid, Grid):
        # a grid smaller than the world is allowed: its groups repeat (grid_groups)
        assert grid.world_size % (grid.data_parts * grid.model_parts) == 0


@SETTINGS
@given(policy=st.one_of(st.sampled_from(["fifo", "priority"]), anything),
       sizes=st.lists(st.one_of(st.integers(-5, 2**24), anything), min_size=5, max_size=5))
def test_scheduler_config(policy: object, sizes: list[object]) -> None:
    names = ("bucket_bytes", "first_bucket_bytes", "partition_bytes", "credit_bytes",
             "urgent_bytes")
    accepted_or_refused(lambda: SchedulerConfig(policy=policy, **dict(zip(names, sizes))))


values = st.one_of(st.sampled_from(["0", "1", "2", "0.5", "-1", "nan", "inf", "bf16", "fp16",
                                    "true", "x", "", "1e9"]), st.text(max_size=6))
specs = st.one_of(
    st.text(max_size=30),
    st.builds(lambda name, items: name + (":" + ",".join(items) if items else ""),
              st.sampled_from([*CODECS, "nonsense"]),
              st.lists(st.one_of(values, st.builds(lambda k, v: f"{k}={v}", st.sampled_from(
                  ["ratio", "rank", "dtype", "block_size", "momentum", "error_feedback", "bogus"]),
                  values)), max_size=3)),
    anything,
)


@SETTINGS
@given(spec=specs)
def test_codec_specs(spec: object) -> None:
    accepted_or_refused(lambda: make_codec(spec))
    accepted_or_refused(lambda: CompressionConfig(codec=spec))
    accepted_or_refused(lambda: CompressionConfig(layers={"*": spec}))


@pytest.mark.parametrize("spec", ["nonsense", "topk:ratio=2"])
def test_bad_specs_from_the_issue_fail_at_construction(spec: str) -> None:
    with pytest.raises(ValueError):
        CompressionConfig(codec=spec)


@pytest.fixture(scope="module")
def dist() -> Iterator[scaleout.Distribution]:
    env = scaleout.init(timeout=10, environ={})
    try:
        yield env.create_distribution()
    finally:
        env.finalize()


DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool,
          torch.complex64, torch.float16]
tensors = st.one_of(
    st.builds(lambda dtype, shape: torch.zeros(shape, dtype=dtype), st.sampled_from(DTYPES),
              st.lists(st.integers(0, 3), max_size=3)),
    anything,
)
ops = st.one_of(st.sampled_from(list(ReduceOp)), anything)


@SETTINGS
@given(operation=st.sampled_from(["allreduce", "reduce", "bcast", "allgather", "allgatherv",
                                  "gather", "scatter", "reduce_scatter", "alltoall",
                                  "alltoallv"]),
       tensor=tensors, op=ops, root=small_ints, counts=small_ints, out=st.one_of(tensors),
       group=st.one_of(st.sampled_from(list(GroupType)), anything))
def test_collective_arguments(dist: scaleout.Distribution, operation: str, tensor: object,
                              op: object, root: object, counts: object, out: object,
                              group: object) -> None:
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: dist.allreduce(tensor, op, group=group),
        "reduce": lambda: dist.reduce(tensor, root, op, group=group),
        "bcast": lambda: dist.bcast(tensor, root, group=group),
        "allgather": lambda: dist.allgather(tensor, group=group, out=out),
        "allgatherv": lambda: dist.allgatherv(tensor, counts, group=group),
        "gather": lambda: dist.gather(tensor, root, group=group),
        "scatter": lambda: dist.scatter(tensor, root, group=group, out=out),
        "reduce_scatter": lambda: dist.reduce_scatter(tensor, op, group=group, out=out),
        "alltoall": lambda: dist.alltoall(tensor, group=group, out=out),
        "alltoallv": lambda: dist.alltoallv(tensor, counts, counts, group=group, out=out),
    }
    request = accepted_or_refused(calls[operation])
    if not isinstance(request, Exception):
        request.wait(timeout=5)


@SETTINGS
@given(check=st.one_of(st.sampled_from(["off", "first", "full", True, False, None]), anything),
       env_check=st.one_of(st.sampled_from(["", "0", "1", "first", "full"]), st.text(max_size=5)))
def test_init_check_consistency(check: object, env_check: str) -> None:
    from scaleout.core.env import _check_mode  # what init() resolves (init needs no group here)

    mode = accepted_or_refused(lambda: _check_mode(check, {"SCALEOUT_CHECK": env_check}))
    assert isinstance(mode, Exception) or mode in ("off", "first", "full")


@SETTINGS
@given(text=st.one_of(st.sampled_from(["", "0", "15", "0.5", "-1", "inf", "nan", "1e9"]),
                      st.text(max_size=8)))
def test_heartbeat_setting(text: str) -> None:
    from scaleout.core.watchdog import heartbeat_limit

    limit = accepted_or_refused(lambda: heartbeat_limit({"SCALEOUT_HEARTBEAT": text}))
    assert limit is None or isinstance(limit, (float, Exception))
    assert not isinstance(limit, float) or limit >= 0.5  # (beats every limit / 5)


@SETTINGS
@given(nprocs=small_ints, nnodes=small_ints, node_rank=small_ints, port=small_ints)
def test_launch_config(nprocs: object, nnodes: object, node_rank: object, port: object) -> None:
    from scaleout.launch.launcher import LaunchConfig

    accepted_or_refused(lambda: LaunchConfig(nprocs=nprocs, nnodes=nnodes, node_rank=node_rank,
                                             master_port=port,
                                             env={"SCALEOUT_JOB_TOKEN": "t"}))


numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 2**70),
                    anything)
trace_layers = st.one_of(
    st.fixed_dictionaries({"name": st.text(max_size=4), "forward_s": numbers,
                           "backward_s": st.one_of(numbers, st.lists(numbers, max_size=3)),
                           "grad_bytes": numbers}),
    anything)


@SETTINGS
@given(batch_size=numbers, layers=st.lists(trace_layers, min_size=1, max_size=3))
def test_trace_files(batch_size: object, layers: list[object]) -> None:
    import math

    from scaleout.sim.trace import workload_from_dict
    from scaleout.sim.workload import Workload

    workload = accepted_or_refused(lambda: workload_from_dict(
        {"format": "scaleout-trace", "version": 2, "batch_size": batch_size, "layers": layers}))
    if isinstance(workload, Workload):  # what the simulator can price
        assert math.isfinite(workload.compute_s) and isinstance(workload.batch_size, int)
        assert all(isinstance(layer.grad_bytes, int) for layer in workload.layers)


rates = st.one_of(st.sampled_from(["1e-300bps", "1bps", "0.1bps", "100Gbps", "1e300GB/s", "0bps",
                                   "nan", "inf", "5"]), st.text(max_size=6))
sizes = st.one_of(st.sampled_from(["0", "1", "64MB", "1e300", "1e306", "1e400", "-1"]),
                  st.text(max_size=6))
latencies = st.one_of(st.sampled_from(["0us", "5us", "1e300s", "1e-300s"]), st.text(max_size=6))


@SETTINGS
@given(bandwidth=rates, size=sizes, latency=latencies, npus=st.sampled_from(["1", "8", "1000"]))
def test_sim_collective_prints_finite_numbers_or_refuses(capsys, bandwidth: str, size: str,
                                                         latency: str, npus: str) -> None:
    import json

    from scaleout.cli.main import main

    code = main(["sim", "collective", "--topology", npus, f"--bandwidth={bandwidth}",
                 f"--latency={latency}", f"--size={size}", "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 2), (code, err)
    if code == 0:  # never Infinity or NaN (JSON cannot hold them)
        json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in {out}"))
    else:
        assert err.startswith("scaleout sim: error: ") and not out
