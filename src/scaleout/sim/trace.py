"""Recorded traces of single-rank runs: the JSON format the trace workload reads.

A trace is what one rank measured, per layer, in a run with nothing to wait for; the
simulator re-scales it to other node counts (through the topology), per-rank batch sizes and
device speeds (:meth:`~scaleout.sim.workload.Workload.scaled`). The format, version 2::

    {
      "format": "scaleout-trace",
      "version": 2,
      "workload": "resnet18",          # a name for reports
      "batch_size": 32,                # samples per rank in the recorded run
      "device": "cpu",                 # optional, free text
      "command": "scaleout bench ...", # optional: how it was recorded
      "layers": [                      # forward order
        {"name": "conv1",
         "forward_s": 0.011,           # seconds, or a list of per-iteration samples
         "backward_s": [0.021, 0.022], # (the median is used)
         "grad_bytes": 37632,          # bytes of this layer's gradients (0: none)
         "update_s": 0.0}              # optional: optimizer update seconds (or samples)
      ]
    }

A sample is a layer's whole forward (or backward, or update) in one iteration. Recording such
a file from ``DataParallel`` is the runtime's business (``scaleout.session.trace``, which adds
the spans it timed under ``"events"``, each checked by :func:`recorded_event` where read);
anything that writes this JSON feeds the simulator.

Version 1 has the same layout and is still read. The runtime's recorder wrote version 1 with
one sample per timed span, that is one per parameter gradient in backward (a weight and a bias:
two samples per iteration, whose median was about half the layer's backward); a version 1 file
that carries ``"events"`` therefore gets its ``forward_s`` / ``backward_s`` samples re-derived
from its events, summed per layer, phase and iteration.

Example:
    >>> w = workload_from_dict({"format": "scaleout-trace", "version": 2, "workload": "t",
    ...     "batch_size": 4, "layers": [{"name": "a", "forward_s": [1.0, 3.0, 2.0],
    ...     "backward_s": 4.0, "grad_bytes": 16}]})
    >>> w.layers[0].forward_s
    2.0
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections.abc import Mapping

from scaleout.session.trace import LANES  # the lanes of a recorded trace's events
from scaleout.sim.workload import Layer, Workload

__all__ = [
    "FORMAT",
    "VERSION",
    "LANES",
    "recorded_event",
    "workload_from_dict",
    "workload_to_dict",
    "read_trace",
    "write_trace",
]

FORMAT = "scaleout-trace"
VERSION = 2
READABLE = (1, 2)  # versions read (1: see the module docstring)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(layer: Mapping, key: str, default: float | None = None) -> float:
    value = layer.get(key, default)
    if isinstance(value, list) and not value:
        raise ValueError(f"layer {layer.get('name')!r}: {key} is an empty list")
    samples = value if isinstance(value, list) else [value]
    if all(_is_number(x) for x in samples):
        with contextlib.suppress(OverflowError):  # (an integer too large for a float)
            return float(statistics.median(samples))
    raise ValueError(
        f"layer {layer.get('name')!r}: {key} must be seconds (a number or a "
        f"list of numbers), got {value!r}"
    )


def _integer(data: Mapping, key: str, default: int, where: str = "") -> int:
    """``data[key]`` (``default`` when absent), which must be an integer (not 5.5 or true)."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}{key} must be an integer, got {value!r}")
    return value


def _finite(value: object) -> bool:
    """A number that is a finite float (10**400 is not: it has no float)."""
    try:
        return _is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def recorded_event(index: int, event: object) -> Mapping:
    """``event``, number ``index`` of a recorded trace's ``events``, once checked: an object
    on one of :data:`LANES` with finite ``start`` <= ``end`` seconds and an integer
    ``iteration`` (its other keys are free: ``phase``, ``bytes``, ``codec``...).

    Raises:
        ValueError: it is not, naming the event by index (and name).
    """
    if not isinstance(event, Mapping):
        raise ValueError(f"event {index} must be an object (lane, name, start, end, "
                         f"iteration), got {event!r}")
    where = f"event {index} ({event.get('name')!r})"
    if event.get("lane") not in LANES:
        raise ValueError(f"{where}: lane must be one of {LANES}, got {event.get('lane')!r}")
    start, end = event.get("start"), event.get("end")
    if not (_finite(start) and _finite(end) and end >= start):
        raise ValueError(f"{where}: start and end must be seconds (finite, end >= start), "
                         f"got {start!r} and {end!r}")
    iteration = event.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        raise ValueError(f"{where}: iteration must be an integer, got {iteration!r}")
    return event


def _recorded_samples(events: list) -> dict[tuple[str, str], list[float]]:
    """(layer, phase) -> per-iteration sums of the compute spans of ``events`` (a recorded
    trace's), in iteration order."""
    sums: dict[tuple[str, str], dict[int, float]] = {}
    for i, event in enumerate(events):
        if not isinstance(event, Mapping) or event.get("lane") != "compute":
            continue
        phase = event.get("phase")
        if phase not in ("forward", "backward"):
            continue
        event = recorded_event(i, event)
        per = sums.setdefault((str(event.get("name")), phase), {})
        iteration = event["iteration"]
        per[iteration] = per.get(iteration, 0.0) + (event["end"] - event["start"])
    return {key: list(per.values()) for key, per in sums.items()}


def _v1_recorded(layers: list, events: list) -> list:
    """``layers`` of a version 1 recorded trace with samples re-derived from ``events``."""
    samples = _recorded_samples(events)
    fixed = []
    for layer in layers:
        if isinstance(layer, Mapping):
            name = str(layer.get("name"))
            layer = {**layer, **{f"{phase}_s": samples[(name, phase)]
                                 for phase in ("forward", "backward") if (name, phase) in samples}}
        fixed.append(layer)
    return fixed


def workload_from_dict(data: Mapping) -> Workload:
    """A :class:`Workload` from a parsed trace.

    Raises:
        ValueError: not a scaleout trace of a known version, a batch size or byte count that
            is not an integer, or a malformed layer (times must be finite seconds >= 0).
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ValueError(
            f"not a scaleout trace: expected format {FORMAT!r}, got "
            f"{data.get('format') if isinstance(data, Mapping) else type(data).__name__!r}"
        )
    version = data.get("version")
    if isinstance(version, bool) or version not in READABLE:
        raise ValueError(
            f"trace version {version!r} not supported (expected one of {READABLE})"
        )
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError("trace needs a non-empty 'layers' list")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Mapping):
            raise ValueError(f"layer {i} must be an object (name, forward_s, backward_s, "
                             f"grad_bytes), got {layer!r}")
    if version == 1 and isinstance(data.get("events"), list):
        layers = _v1_recorded(layers, data["events"])
    return Workload(
        name=str(data.get("workload", "trace")),
        batch_size=_integer(data, "batch_size", 1),
        layers=tuple(
            Layer(
                name=str(layer.get("name", f"layer{i}")),
                forward_s=_seconds(layer, "forward_s"),
                backward_s=_seconds(layer, "backward_s"),
                grad_bytes=_integer(layer, "grad_bytes", 0,
                                    f"layer {layer.get('name', f'layer{i}')!r}: "),
                update_s=_seconds(layer, "update_s", 0.0),
            )
            for i, layer in enumerate(layers)
        ),
    )


def workload_to_dict(workload: Workload, **extra: object) -> dict:
    """The trace of ``workload`` (``extra`` keys such as ``device`` or ``command`` are kept)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "workload": workload.name,
        "batch_size": workload.batch_size,
        **extra,
        "layers": [
            {
                "name": lay.name,
                "forward_s": lay.forward_s,
                "backward_s": lay.backward_s,
                "grad_bytes": lay.grad_bytes,
                "update_s": lay.update_s,
            }
            for lay in workload.layers
        ],
    }


def read_trace(path: str | os.PathLike) -> Workload:
    """Read a trace file.

    Raises:
        ValueError: the file is not valid JSON or not a trace (the path is named).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return workload_from_dict(data)
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{os.fspath(path)}: {err}") from err


def write_trace(path: str | os.PathLike, workload: Workload, **extra: object) -> None:
    """Write ``workload`` as a trace file."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(workload_to_dict(workload, **extra), f, indent=1)
