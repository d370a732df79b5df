"""Horovod's timeline: every collective's span, as a Chrome trace (``chrome://tracing``, Perfetto).

Each rank records the spans of its own collectives, from submission to the moment
``synchronize`` saw them complete; :func:`stop_timeline` gathers every rank's spans and rank 0
writes one JSON file with one process row per rank and one thread row per collective kind.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from scaleout.horovod.context import Runtime, runtime
from scaleout.horovod.objects import allgather_object

__all__ = ["start_timeline", "stop_timeline", "record_span"]

_KEY = "timeline"


@dataclass
class _Recording:
    path: str
    mark_cycles: bool
    origin: float = field(default_factory=time.perf_counter)
    events: list[dict[str, Any]] = field(default_factory=list)


def record_span(rt: Runtime, kind: str, name: str, start: float, end: float) -> None:
    """Record one collective's span (``time.perf_counter`` seconds) if a timeline is on."""
    recording = rt.extras.get(_KEY)
    if recording is None:
        return
    recording.events.append({
        "name": name, "cat": kind, "ph": "X", "pid": rt.env.rank, "tid": kind,
        "ts": round((start - recording.origin) * 1e6, 3),
        "dur": round(max(end - start, 0.0) * 1e6, 3),
    })


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording collectives; rank 0 writes them to ``file_path`` at :func:`stop_timeline`.

    Args:
        file_path: where rank 0 writes the Chrome trace JSON.
        mark_cycles: accepted for Horovod compatibility (scaleout has no fusion cycles).

    Raises:
        TypeError: ``file_path`` is not a string or path.
        ValueError: a timeline is already being recorded.
    """
    if not isinstance(file_path, (str, os.PathLike)):
        raise TypeError(f"start_timeline: file_path must be a path, got {type(file_path).__name__}")
    rt = runtime()
    if rt.extras.get(_KEY) is not None:
        raise ValueError(f"start_timeline: a timeline is already recording to "
                         f"{rt.extras[_KEY].path!r}; call stop_timeline() first")
    rt.extras[_KEY] = _Recording(path=os.fspath(file_path), mark_cycles=mark_cycles)
    hooks = rt.extras.setdefault("on_shutdown", [])
    if _on_shutdown not in hooks:
        hooks.append(_on_shutdown)


def stop_timeline() -> None:
    """Stop recording; every rank calls it; rank 0 writes the trace. Without a timeline: no-op."""
    rt = runtime()
    recording = rt.extras.pop(_KEY, None)
    if recording is None:
        return
    _write(rt, recording)


def _write(rt: Runtime, recording: _Recording) -> None:
    every = allgather_object(recording.events, name="timeline")
    if rt.env.rank != 0:
        return
    events: list[dict[str, Any]] = []
    for rank, spans in enumerate(every):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.extend(spans)
    with open(recording.path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)


def _on_shutdown(rt: Runtime) -> None:
    recording = rt.extras.pop(_KEY, None)
    if recording is not None:
        _write(rt, recording)
