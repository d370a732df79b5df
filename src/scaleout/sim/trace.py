"""Recorded traces of single-rank runs: the JSON format the trace workload reads.

A trace is what one rank measured, per layer, in a run with nothing to wait for; the
simulator re-scales it to other node counts (through the topology), per-rank batch sizes and
device speeds (:meth:`~scaleout.sim.workload.Workload.scaled`). The format, version 1::

    {
      "format": "scaleout-trace",
      "version": 1,
      "workload": "resnet18",          # a name for reports
      "batch_size": 32,                # samples per rank in the recorded run
      "device": "cpu",                 # optional, free text
      "command": "scaleout bench ...", # optional: how it was recorded
      "layers": [                      # forward order
        {"name": "conv1",
         "forward_s": 0.011,           # seconds, or a list of per-iteration samples
         "backward_s": [0.021, 0.022], # (the median is used)
         "grad_bytes": 37632,          # bytes of this layer's gradients (0: none)
         "update_s": 0.0}              # optional: optimizer update seconds
      ]
    }

Recording such a file from ``DataParallel`` is the runtime's business; anything that writes
this JSON feeds the simulator.

Example:
    >>> w = workload_from_dict({"format": "scaleout-trace", "version": 1, "workload": "t",
    ...     "batch_size": 4, "layers": [{"name": "a", "forward_s": [1.0, 3.0, 2.0],
    ...     "backward_s": 4.0, "grad_bytes": 16}]})
    >>> w.layers[0].forward_s
    2.0
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping

from scaleout.sim.workload import Layer, Workload

__all__ = [
    "FORMAT",
    "VERSION",
    "workload_from_dict",
    "workload_to_dict",
    "read_trace",
    "write_trace",
]

FORMAT = "scaleout-trace"
VERSION = 1


def _seconds(layer: Mapping, key: str, default: float | None = None) -> float:
    value = layer.get(key, default)
    if isinstance(value, list):
        if not value:
            raise ValueError(f"layer {layer.get('name')!r}: {key} is an empty list")
        value = statistics.median(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"layer {layer.get('name')!r}: {key} must be seconds (a number or a "
            f"list of numbers), got {value!r}"
        )
    return float(value)


def workload_from_dict(data: Mapping) -> Workload:
    """A :class:`Workload` from a parsed trace.

    Raises:
        ValueError: not a scaleout trace of a known version, or a malformed layer.
    """
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ValueError(
            f"not a scaleout trace: expected format {FORMAT!r}, got "
            f"{data.get('format') if isinstance(data, Mapping) else type(data).__name__!r}"
        )
    if data.get("version") != VERSION:
        raise ValueError(
            f"trace version {data.get('version')!r} not supported (expected {VERSION})"
        )
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError("trace needs a non-empty 'layers' list")
    return Workload(
        name=str(data.get("workload", "trace")),
        batch_size=int(data.get("batch_size", 1)),
        layers=tuple(
            Layer(
                name=str(layer.get("name", f"layer{i}")),
                forward_s=_seconds(layer, "forward_s"),
                backward_s=_seconds(layer, "backward_s"),
                grad_bytes=int(layer.get("grad_bytes", 0)),
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
