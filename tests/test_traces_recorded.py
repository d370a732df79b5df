"""Recorded traces of DataParallel runs: what an iteration is, what each layer's samples hold,
where each model's file goes, and the ``sim chrome`` reader's checks.

An iteration is a training step (a forward, the backward after it, that backward's
communication, waits and update): its spans share one label, the first step's forward
included; evaluation forwards are no iteration. Each comment says what the code before did,
measured on these very runs.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleout
from harness import run_ranks
from scaleout.cli.main import main
from scaleout.pytorch import DataParallel, DistributedOptimizer
from scaleout.session.trace import TraceRecorder
from scaleout.sim.trace import read_trace

STEPS, BATCH, EVAL_BATCH = 3, 8, 64


def _net(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 8))


def _step(model: DataParallel, opt: DistributedOptimizer, batch: int = BATCH) -> None:
    model(torch.randn(batch, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def body_train_then_evaluate(folder: str) -> int:
    """Three training steps, then forwards no backward follows: one with grad enabled (a
    validation loss left outside no_grad) and five under eval() and no_grad()."""
    env = scaleout.init(timeout=30)
    net = _net()
    model = DataParallel(net, env.create_distribution(), trace=folder)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), model)
    for _ in range(STEPS):
        _step(model, opt)
    model(torch.randn(EVAL_BATCH, 16))  # grad enabled, no backward
    model.eval()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(EVAL_BATCH, 16))
    iterations = model.statistics.iterations
    model.close()
    env.finalize()
    return iterations


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, int, Path]:
    folder = tmp_path_factory.mktemp("trace")
    (iterations,) = run_ranks(1, body_train_then_evaluate, str(folder), timeout=60)
    path = folder / "trace.0.json"
    return json.loads(path.read_text()), iterations, path


def test_evaluation_forwards_are_not_training_iterations(recorded) -> None:
    data, iterations, _ = recorded
    # before: Statistics.iterations 9 and the trace's 9 (every forward ended an iteration),
    # batch_size 64 (the last forward's), 8 forward samples per layer against 3 backward ones
    # (the eval forwards' in, the first training forward's out)
    assert iterations == STEPS and data["iterations"] == STEPS
    assert data["batch_size"] == BATCH
    for layer in data["layers"]:
        assert len(layer["forward_s"]) == len(layer["backward_s"]) == STEPS, layer["name"]
    forwards = [e for e in data["events"] if e.get("phase") == "forward"]
    assert len(forwards) == 2 * (STEPS + 1)  # the training steps' and the grad-enabled one's


def test_a_step_shares_one_label_and_the_first_forward_is_recorded(recorded) -> None:
    data, _, _ = recorded
    per_phase: dict[str, Counter] = {}
    for e in data["events"]:
        per_phase.setdefault(e.get("phase") or e["lane"], Counter())[e["iteration"]] += 1
    # before: forward labelled 1..2 (the first forward untraced), backward/update/wait 1..3
    steps = set(range(STEPS))
    for phase in ("backward", "update", "wait"):
        assert set(per_phase[phase]) == steps, (phase, per_phase[phase])
    # (3: the forward no backward followed, an event but no sample)
    assert per_phase["forward"] == {0: 2, 1: 2, 2: 2, 3: 2}


def test_updates_are_priced_per_layer_by_their_gradient_bytes(recorded) -> None:
    data, _, path = recorded
    updates: Counter = Counter()
    for e in data["events"]:
        if e.get("phase") == "update":
            updates[e["iteration"]] += e["end"] - e["start"]
    # before: no layer had update_s, so the simulator read 0.0 for every update
    per_iteration = [sum(layer["update_s"][i] for layer in data["layers"])
                     for i in range(STEPS)]
    assert per_iteration == pytest.approx([updates[i] for i in range(STEPS)], rel=1e-9)
    first, second = data["layers"]  # grad_bytes 2176 and 1056: the same split every step
    share = first["grad_bytes"] / (first["grad_bytes"] + second["grad_bytes"])
    for i in range(STEPS):
        assert first["update_s"][i] == pytest.approx(per_iteration[i] * share, rel=1e-9)
    assert all(layer.update_s > 0 for layer in read_trace(path).layers)


def test_an_update_span_is_split_over_the_layers_it_names() -> None:
    trace = TraceRecorder(rank=0)
    for name, nbytes in (("a", 100), ("b+c", 300), ("d", 0)):
        trace.set_grad_bytes(name, nbytes)
    t0 = trace.now()
    trace.span("compute", "a", t0, t0 + 1.0, phase="forward")
    trace.span("compute", "a", t0, t0 + 2.0, phase="backward")
    trace.end_iteration()  # overlap mode: the update runs in the next forward...
    trace.begin_forward(8)
    trace.span("compute", "update a+b+c", t0, t0 + 4.0, phase="update")
    trace.span("compute", "update d", t0, t0 + 1.0, phase="update")
    trace.span("compute", "a", t0, t0 + 1.0, phase="backward")  # step 1's: labelled 1
    # before: no update_s (and no begin_forward); an update span took the label of the
    # iteration after its backward's
    layers = {layer["name"]: layer for layer in trace.to_dict()["layers"]}
    assert layers["a"]["update_s"] == [1.0]  # by grad bytes: 100 of 400...
    assert trace._layers["b+c"]["update_s"] == {0: 3.0}  # ...and 300 of 400, in step 0
    assert trace._layers["d"]["update_s"] == {0: 1.0}  # alone (no bytes known): all of it
    assert [e["iteration"] for e in trace.to_dict()["events"]] == [0, 0, 0, 0, 1]


def body_one_step_two_models(folder: str) -> list[str]:
    """One training step of two traced models in one process (a GAN's G and D)."""
    env = scaleout.init(timeout=30)
    g, d = _net(), nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    gen = DataParallel(g, env.create_distribution(), trace=folder)
    dis = DataParallel(d, env.create_distribution(), trace=folder)
    opts = [DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), dp)
            for m, dp in ((g, gen), (d, dis))]
    dis(gen(torch.randn(BATCH, 16))).mean().backward()
    for opt in opts:
        opt.step()
    paths = [gen.write_trace(), dis.write_trace()]
    gen.close()
    dis.close()
    env.finalize()
    return paths


def test_one_step_records_every_layer_and_two_models_keep_their_own_files(tmp_path) -> None:
    (paths,) = run_ranks(1, body_one_step_two_models, str(tmp_path), timeout=60)
    # before: both wrote trace.0.json (the one closed last, D, replaced G's)
    assert paths == [str(tmp_path / "trace.0.json"), str(tmp_path / "trace.0.1.json")]
    assert sorted(os.listdir(tmp_path)) == ["trace.0.1.json", "trace.0.json"]
    for path, grad_bytes in zip(paths, ([2176, 1056], [2304, 260])):
        data = json.loads(Path(path).read_text())
        # before: "layers": [] (the first forward untraced), which sim run --trace refused
        assert [layer["grad_bytes"] for layer in data["layers"]] == grad_bytes
        assert all(len(layer["forward_s"]) == len(layer["backward_s"]) == 1
                   for layer in data["layers"])
        assert read_trace(path).compute_s > 0
    assert main(["sim", "chrome", str(tmp_path), "--model", "1"]) == 0  # D's spans
    chrome = json.loads((tmp_path / "chrome.json").read_text())
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(json.loads(Path(paths[1]).read_text())["events"])


def body_micro_batches(folder: str) -> tuple[int, list[int]]:
    """Two steps of two micro-batches each, the first under no_sync()."""
    env = scaleout.init(timeout=30)
    net = _net()
    model = DataParallel(net, env.create_distribution(), trace=folder)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model)
    for _ in range(2):
        with model.no_sync():
            model(torch.randn(BATCH, 16)).pow(2).mean().backward()
        _step(model, opt, batch=BATCH // 2)
    iterations = model.statistics.iterations
    model.close()
    env.finalize()
    data = json.loads((Path(folder) / "trace.0.json").read_text())
    return iterations, [len(layer["forward_s"]) for layer in data["layers"]]


def test_a_no_sync_loop_counts_one_iteration_per_exchanged_backward(tmp_path) -> None:
    # before: 4 iterations (one per forward) for 2 optimizer steps
    assert run_ranks(1, body_micro_batches, str(tmp_path), timeout=60)[0] == (2, [2, 2])
    assert json.loads((tmp_path / "trace.0.json").read_text())["batch_size"] == BATCH // 2


def body_bad_folders(folder: str) -> tuple[list[str], bool, bool]:
    """Trace folders that cannot hold files, refused when the model is built; then a
    trace that cannot be written at close(), which closes all the same."""
    env = scaleout.init(timeout=30)
    errors = []
    afile = os.path.join(folder, "afile")
    Path(afile).touch()
    for trace, variable in ((afile, None), (None, "/proc/nope")):
        os.environ.pop("SCALEOUT_TRACE", None)
        if variable:
            os.environ["SCALEOUT_TRACE"] = variable
        try:
            DataParallel(_net(), env.create_distribution(), trace=trace)
        except ValueError as err:
            errors.append(str(err))
    os.environ.pop("SCALEOUT_TRACE", None)
    traced = os.path.join(folder, "traced")
    net = _net()
    model = DataParallel(net, env.create_distribution(), trace=traced)
    _step(model, DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), model))
    model.synchronize()
    shutil.rmtree(traced, ignore_errors=True)
    Path(traced).touch()  # the folder became a file: the write fails
    try:
        model.close()
        raised = False
    except OSError:
        raised = True
    progress = [t for t in threading.enumerate() if t.name == "scaleout-progress"]
    env.finalize()
    return errors, raised, not progress and not model._handles


def test_a_bad_trace_folder_is_refused_when_the_model_is_built(tmp_path) -> None:
    (errors, raised, closed), = run_ranks(1, body_bad_folders, str(tmp_path), timeout=60)
    # before: errors [] (both accepted: FileExistsError / FileNotFoundError tracebacks at
    # close(), after the whole run), and a close() whose write failed left the progress
    # thread running and the hooks on (closed False)
    assert errors == [
        f"trace folder {str(tmp_path / 'afile')!r} (from trace=) cannot hold traces: it exists "
        "and is not a folder",
        "trace folder '/proc/nope' (from SCALEOUT_TRACE) cannot be created: No such file or "
        "directory"]
    assert raised and closed


_EVENT = {"lane": "compute", "name": "a", "start": 0.0, "end": 1.0, "iteration": 0}


def _chrome(tmp_path: Path, events: list) -> int:
    (tmp_path / "trace.0.json").write_text(json.dumps(
        {"format": "scaleout-trace", "version": 2, "rank": 0, "layers": [], "events": events}))
    return main(["sim", "chrome", str(tmp_path)])


@pytest.mark.parametrize(("event", "message"), [  # before: rc 1 and a traceback (ValueError,
    ({**_EVENT, "lane": "network"}, "event 1 ('a'): lane must be one of"),  # TypeError,
    ({**_EVENT, "start": None}, "event 1 ('a'): start and end must be seconds"),  # TypeError)
    (7, "event 1 must be an object"),
    ({**_EVENT, "start": 5.0}, "got 5.0 and 1.0"),  # before: rc 0, a duration of -4e6 us
    ({**_EVENT, "end": float("inf")}, "got 0.0 and inf"),  # before: rc 0, duration inf
    ({**_EVENT, "iteration": 1.5}, "iteration must be an integer, got 1.5"),  # before: 1
])
def test_sim_chrome_refuses_a_malformed_event_in_one_line(tmp_path, capsys, event,
                                                          message: str) -> None:
    assert _chrome(tmp_path, [_EVENT, event]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"scaleout sim: error: {tmp_path / 'trace.0.json'}: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_sim_chrome_keeps_what_each_span_carried(tmp_path) -> None:
    comm = {"lane": "comm", "name": "0.weight", "start": 0.5, "end": 2.0, "iteration": 0,
            "bytes": 64, "raw_bytes": 256, "codec": "blockquant", "priority_lane": 1}
    assert _chrome(tmp_path, [{**_EVENT, "phase": "forward"}, comm]) == 0
    spans = [e for e in json.loads((tmp_path / "chrome.json").read_text())["traceEvents"]
             if e["ph"] == "X"]
    # before: args {"iteration": 0} alone
    assert [e["args"] for e in spans] == [
        {"iteration": 0, "phase": "forward"},
        {"iteration": 0, "bytes": 64, "raw_bytes": 256, "codec": "blockquant",
         "priority_lane": 1}]
