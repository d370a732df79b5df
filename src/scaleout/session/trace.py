"""Traces of real runs: what each rank did, when, per iteration.

A :class:`TraceRecorder` hangs off a session's :class:`~scaleout.session.Statistics`; the
places that time things for statistics also log a span here: each layer's forward and
backward compute, each bucket's communication (bytes, codec, lane), the waits that were
exposed, the optimizer updates. :meth:`TraceRecorder.write` saves one JSON file per rank in
the simulator's trace format (``scaleout.sim.trace``: per-layer ``forward_s`` /
``backward_s`` samples and ``grad_bytes``, so a single-rank run feeds ``scaleout sim run
--trace``) plus every span under ``"events"`` (``scaleout sim chrome`` turns a folder of them
into one Chrome / Perfetto trace, a track per rank).

A layer's sample is its whole forward (or backward) of one iteration: the sum of its spans of
that phase in the iteration. DataParallel laps the stopwatch once per parameter gradient, so a
layer with a weight and a bias logs two backward spans per iteration; each span is an event,
but together they are one sample (version 1 files, written before, kept one sample per span:
``scaleout.sim.trace`` re-derives their samples from the events).

Timestamps are host clock seconds since the recorder started; on a GPU they are the times the
work was issued (the Statistics from CUDA events hold the kernel times).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["TraceRecorder", "LANES", "trace_path"]

LANES = ("compute", "comm", "wait")
FORMAT, VERSION = "scaleout-trace", 2


def trace_path(folder: str | os.PathLike, rank: int) -> str:
    """The file rank ``rank`` writes in ``folder``."""
    return os.path.join(os.fspath(folder), f"trace.{rank}.json")


class TraceRecorder:
    """Spans of one rank (thread-safe: the progress thread logs communication).

    Args:
        rank: the global rank (for the file name and the track).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._iteration = 0
        # forward order of first appearance; forward_s / backward_s: iteration -> summed seconds
        self._layers: dict[str, dict[str, Any]] = {}
        self.batch_size = 1  # samples per rank and iteration (the front end sets it)

    def now(self) -> float:
        return time.perf_counter()

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        """Log a span; ``start``/``end`` are ``time.perf_counter()`` values.

        ``args`` may carry ``phase`` (``forward``/``backward``/``update``) for compute spans
        and ``bytes``, ``codec``, ``priority_lane`` for communication.
        """
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        event = {"lane": lane, "name": name, "start": start - self._t0, "end": end - self._t0,
                 "iteration": self._iteration, **args}
        with self._lock:
            self._events.append(event)
            phase = args.get("phase")
            if lane == "compute" and phase in ("forward", "backward"):
                sums = self._layer(name)[f"{phase}_s"]  # one sample per iteration: the sum
                sums[self._iteration] = sums.get(self._iteration, 0.0) + (end - start)

    def set_grad_bytes(self, layer: str, nbytes: int) -> None:
        """The bytes of ``layer``'s gradients (its parameters' sizes)."""
        with self._lock:
            self._layer(layer)["grad_bytes"] = int(nbytes)

    def _layer(self, name: str) -> dict[str, Any]:
        """``name``'s per-layer record (made on first sight: forward order)."""
        return self._layers.setdefault(name, {"name": name, "forward_s": {}, "backward_s": {},
                                              "grad_bytes": 0})

    def end_iteration(self) -> None:
        with self._lock:
            self._iteration += 1

    def to_dict(self, *, workload: str = "model", batch_size: int | None = None,
                device: str = "cpu", command: str = "") -> dict[str, Any]:
        """The trace (simulator format, plus ``rank`` and ``events``)."""
        with self._lock:
            layers = [{**layer, "forward_s": list(layer["forward_s"].values()),
                       "backward_s": list(layer["backward_s"].values())}
                      for layer in self._layers.values()
                      if layer["forward_s"] and layer["backward_s"]]
            events = list(self._events)
        return {"format": FORMAT, "version": VERSION, "workload": workload,
                "batch_size": batch_size or self.batch_size, "device": device, "command": command,
                "rank": self.rank, "iterations": self._iteration, "layers": layers,
                "events": events}

    def write(self, folder: str | os.PathLike, **meta: Any) -> str:
        """Write ``trace.<rank>.json`` into ``folder`` (created if needed); its path."""
        os.makedirs(folder, exist_ok=True)
        path = trace_path(folder, self.rank)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(**meta), f)
        os.replace(tmp, path)
        return path
