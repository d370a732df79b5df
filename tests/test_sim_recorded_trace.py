"""Recorded traces: one forward and one backward sample per layer and iteration.

DataParallel laps its stopwatch once per parameter gradient, so a layer with a weight and a
bias logs two backward spans per iteration. The trace's samples must be their per-iteration
sums (the simulator takes the median of the samples as the layer's time per iteration); the
version 1 files written before held one sample per span and are re-derived from their events.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.session.trace import TraceRecorder
from scaleout.sim.trace import VERSION, workload_from_dict


def _per_iteration(events: list, layer: str, phase: str) -> list[float]:
    """The oracle: ``layer``'s ``phase`` spans summed per iteration, in iteration order."""
    sums: dict[int, float] = {}
    for e in events:
        if e["lane"] == "compute" and e["name"] == layer and e.get("phase") == phase:
            sums[e["iteration"]] = sums.get(e["iteration"], 0.0) + e["end"] - e["start"]
    return [sums[i] for i in sorted(sums)]


def test_recorder_sums_the_spans_of_a_layer_and_phase_per_iteration() -> None:
    trace = TraceRecorder(rank=0)
    t0 = trace.now()
    for _ in range(3):
        trace.span("compute", "fc", t0, t0 + 1.0, phase="forward")
        trace.span("compute", "fc", t0, t0 + 4.0, phase="backward")  # weight
        trace.span("compute", "fc", t0, t0 + 0.5, phase="backward")  # bias
        trace.span("compute", "update fc", t0, t0 + 9.0, phase="update")
        trace.end_iteration()
    data = trace.to_dict()
    assert data["version"] == VERSION
    (layer,) = data["layers"]
    assert layer["forward_s"] == pytest.approx([1.0] * 3)
    assert layer["backward_s"] == pytest.approx([4.5] * 3)  # not [4.0, 0.5] * 3
    assert len([e for e in data["events"] if e.get("phase") == "backward"]) == 6  # all spans kept
    assert workload_from_dict(data).layers[0].backward_s == pytest.approx(4.5)


def body_two_parameter_layers(folder: str) -> None:
    env = scaleout.init(timeout=30)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))  # weight + bias
    model = DataParallel(net, env.create_distribution(), trace=folder)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model)
    for _ in range(5):
        model(torch.randn(32, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.synchronize()
    model.close()  # writes trace.0.json
    env.finalize()


def test_a_recorded_run_has_one_backward_sample_per_iteration_and_layer(tmp_path) -> None:
    from scaleout.sim.trace import read_trace

    run_ranks(1, body_two_parameter_layers, str(tmp_path), timeout=60)
    path = tmp_path / "trace.0.json"
    data = json.loads(path.read_text())
    workload = read_trace(path)
    assert [layer["name"] for layer in data["layers"]] == ["0", "2"]
    for layer, priced in zip(data["layers"], workload.layers):
        for phase in ("forward", "backward"):
            totals = _per_iteration(data["events"], layer["name"], phase)
            assert len(totals) <= data["iterations"]
            assert layer[f"{phase}_s"] == pytest.approx(totals, rel=1e-9, abs=1e-12)
            assert getattr(priced, f"{phase}_s") == pytest.approx(statistics.median(totals))
        # two gradient hooks per iteration, one sample
        spans = [e for e in data["events"]
                 if e["name"] == layer["name"] and e.get("phase") == "backward"]
        assert len(spans) == 2 * len(layer["backward_s"])


def _v1_recorded() -> dict:
    """A trace as the recorder wrote it before: version 1, one sample per span."""
    events = []
    for it in (1, 2, 3):
        events += [
            {"lane": "compute", "name": "fc", "start": 0.0, "end": 0.001, "iteration": it,
             "phase": "forward"},
            {"lane": "compute", "name": "fc", "start": 0.0, "end": 0.004, "iteration": it,
             "phase": "backward"},
            {"lane": "compute", "name": "fc", "start": 0.0, "end": 0.0001, "iteration": it,
             "phase": "backward"},
            {"lane": "comm", "name": "fc", "start": 0.0, "end": 0.5, "iteration": it,
             "bytes": 64},
        ]
    return {"format": "scaleout-trace", "version": 1, "workload": "model", "batch_size": 8,
            "rank": 0, "iterations": 3, "events": events,
            "layers": [{"name": "fc", "forward_s": [0.001] * 3,
                        "backward_s": [0.004, 0.0001] * 3, "grad_bytes": 64}]}


def test_version_1_recorded_traces_still_load_with_samples_from_their_events() -> None:
    layer = workload_from_dict(_v1_recorded()).layers[0]
    assert layer.forward_s == pytest.approx(0.001)
    assert layer.backward_s == pytest.approx(0.0041)  # not the median of the laps, 0.00205


def test_version_1_traces_without_events_keep_their_samples() -> None:
    data = _v1_recorded()
    del data["events"]
    assert workload_from_dict(data).layers[0].backward_s == pytest.approx(0.00205)


def test_malformed_events_of_a_version_1_trace_and_unknown_versions_are_refused() -> None:
    data = _v1_recorded()
    data["events"][1]["end"] = "late"
    with pytest.raises(ValueError, match=r"event 1 \('fc'\): start and end must be seconds"):
        workload_from_dict(data)
    data = _v1_recorded()
    data["events"][0]["iteration"] = None
    with pytest.raises(ValueError, match="event 0 .*iteration must be an integer, got None"):
        workload_from_dict(data)
    with pytest.raises(ValueError, match=r"trace version 3 not supported \(expected one of"):
        workload_from_dict({**_v1_recorded(), "version": 3})


_LAYER = {"name": "fc", "forward_s": 0.01, "backward_s": [0.02], "grad_bytes": 64}


@pytest.mark.parametrize(("change", "message"), [
    ({"layers": [1, 2]}, "layer 0 must be an object"),  # were AttributeError tracebacks
    ({"layers": [_LAYER, None]}, "layer 1 must be an object"),
    ({"batch_size": 32.5}, "batch_size must be an integer, got 32.5"),  # were int()-ed
    ({"batch_size": True}, "batch_size must be an integer, got True"),
    ({"batch_size": None}, "batch_size must be an integer, got None"),
    ({"layers": [{**_LAYER, "grad_bytes": 5.5}]}, "'fc': grad_bytes must be an integer, got 5.5"),
    ({"layers": [{**_LAYER, "grad_bytes": True}]}, "grad_bytes must be an integer, got True"),
    ({"layers": [{**_LAYER, "grad_bytes": math.inf}]}, "grad_bytes must be an integer, got inf"),
    ({"layers": [{**_LAYER, "grad_bytes": 1e300}]}, "grad_bytes must be an integer, got 1e+300"),
    ({"layers": [{**_LAYER, "forward_s": math.inf}]},  # inf and nan in the output
     "Layer.forward_s must be a finite number >= 0, got inf"),
    ({"layers": [{**_LAYER, "backward_s": [0.02, 10**400]}]}, "backward_s must be seconds"),
    ({"layers": [{**_LAYER, "backward_s": [0.02, "late"]}]}, "backward_s must be seconds"),
])
def test_a_malformed_trace_is_refused_in_one_line(tmp_path, capsys, change: dict,
                                                  message: str) -> None:
    from scaleout.cli.main import main

    path = tmp_path / "t.json"
    # (json writes inf as Infinity, which it reads back as inf, as it reads 1e400)
    path.write_text(json.dumps({"format": "scaleout-trace", "version": 2, "batch_size": 4,
                                "layers": [_LAYER], **change}))
    assert main(["sim", "run", "--trace", str(path), "--topology", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"scaleout sim: error: {path}: ") and message in err
    assert len(err.strip().splitlines()) == 1
