"""Chrome trace JSON (Perfetto, chrome://tracing) of a simulated run.

One process (track) per rank, three threads (lanes) in each: ``compute``, ``comm`` and
``wait``, the same layout as the runtime's recorded traces. Data-parallel ranks are
symmetric, so the simulated rank's spans are repeated on each of the first ``ranks`` tracks.

Example:
    >>> from scaleout.sim.iteration import Span
    >>> doc = chrome_trace([Span("compute", "forward a", 0.0, 1e-3, 0)], ranks=1)
    >>> [e["dur"] for e in doc["traceEvents"] if e["ph"] == "X"]
    [1000.0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scaleout.sim.iteration import Span
from scaleout.sim.trace import LANES, recorded_event

__all__ = ["LANES", "RecordedSpan", "chrome_trace", "chrome_trace_of_ranks",
           "write_chrome_trace", "recorded_spans"]

_SPAN_KEYS = ("lane", "name", "start", "end", "iteration")


@dataclass(frozen=True)
class RecordedSpan(Span):
    """A span of a real run with what its event carried besides (a bucket's ``bytes``,
    ``raw_bytes``, ``codec`` and ``priority_lane``, a compute span's ``phase``): the Chrome
    event's ``args``, so Perfetto shows what each span moved and where."""

    args: Mapping[str, Any] = field(default_factory=dict)


def chrome_trace(spans: Iterable[Span], *, ranks: int = 1, metadata: dict | None = None) -> dict:
    """The trace document (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) of a
    simulated rank, repeated on ``ranks`` tracks (data-parallel ranks are symmetric).

    Raises:
        ValueError: ``ranks`` < 1 or a span on an unknown lane.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    spans = list(spans)
    return chrome_trace_of_ranks([spans] * ranks, metadata=metadata)


def chrome_trace_of_ranks(per_rank: Sequence[Iterable[Span]], *,
                          metadata: dict | None = None) -> dict:
    """The trace document with track ``i`` holding ``per_rank[i]``'s spans (real runs).

    Raises:
        ValueError: a span on an unknown lane.
    """
    events: list[dict] = []
    for rank, spans in enumerate(per_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(LANES):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}}
            )
        for span in spans:
            if span.lane not in LANES:
                raise ValueError(f"span lane must be one of {LANES}, got {span.lane!r}")
            events.append(
                {
                    "ph": "X",
                    "name": span.name,
                    "cat": span.lane,
                    "pid": rank,
                    "tid": LANES.index(span.lane),
                    "ts": span.start * 1e6,
                    "dur": (span.end - span.start) * 1e6,
                    "args": _args(span),
                }
            )
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        doc["otherData"] = metadata
    return doc


def _args(span: Span) -> dict:
    """A Chrome event's ``args``: the iteration, and a recorded span's other fields."""
    extra = span.args if isinstance(span, RecordedSpan) else {}
    return {"iteration": span.iteration, **extra}


def write_chrome_trace(
    path: str | os.PathLike, spans: Iterable[Span], *, ranks: int = 1, metadata: dict | None = None
) -> None:
    """Write :func:`chrome_trace` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(spans, ranks=ranks, metadata=metadata), f)


def recorded_spans(trace: dict) -> list[RecordedSpan]:
    """The spans of a trace recorded by a real run (``scaleout.session.trace``), one rank.

    Raises:
        ValueError: the trace holds no ``events`` (not recorded by a run), or an event that
            is not an object on a known lane with finite seconds, end >= start, and an
            integer iteration (:func:`~scaleout.sim.trace.recorded_event`; named by index).
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("events"), list):
        raise ValueError("not a recorded trace: it has no 'events' list (record one with "
                         "DataParallel(trace=FOLDER) or SCALEOUT_TRACE=FOLDER)")
    return [_recorded_span(recorded_event(i, event)) for i, event in enumerate(trace["events"])]


def _recorded_span(event: Mapping) -> RecordedSpan:
    return RecordedSpan(event["lane"], str(event.get("name", "")), float(event["start"]),
                        float(event["end"]), event["iteration"],
                        args={k: v for k, v in event.items() if k not in _SPAN_KEYS})
