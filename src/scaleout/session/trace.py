"""Traces of real runs: what each rank did, when, per iteration.

A :class:`TraceRecorder` hangs off a session's :class:`~scaleout.session.Statistics`; the
places that time things for statistics also log a span here: each layer's forward and
backward compute, each bucket's communication (bytes, codec, lane), the waits that were
exposed, the optimizer updates. :meth:`TraceRecorder.write` saves one JSON file per rank in
the simulator's trace format (``scaleout.sim.trace``: per-layer ``forward_s`` /
``backward_s`` / ``update_s`` samples and ``grad_bytes``, so a single-rank run feeds
``scaleout sim run --trace``) plus every span under ``"events"`` (``scaleout sim chrome``
turns a folder of them into one Chrome / Perfetto trace, a track per rank).

An iteration is a training step: a forward, the backward that follows it (whose end, in
DataParallel, ends the iteration) and the communication, waits and update of that backward's
gradients. Its spans share one ``iteration`` label, although in overlap mode the update and
its waits run inside the next forward: they carry the label of the backward whose gradients
they apply. A forward counts once a backward follows it (before the next forward): an
evaluation forward, or all but the last micro-batch of a ``no_sync()`` loop (whose backward
is not timed), leaves its spans under ``events`` but no sample, and does not set
``batch_size``.

A layer's sample is its whole forward (or backward, or update) of one iteration: the sum of
its spans of that phase in the iteration. DataParallel laps the stopwatch once per parameter
gradient, so a layer with a weight and a bias logs two backward spans per iteration; each
span is an event, but together they are one sample (version 1 files, written before, kept one
sample per span: ``scaleout.sim.trace`` re-derives their samples from the events). An update
span names the layers it updated (``update 0+2``: several layers' updates run as one
optimizer step); its time is split over them in proportion to their ``grad_bytes`` (an
elementwise optimizer's time grows with the parameters it walks).

Timestamps are host clock seconds since the recorder started; on a GPU they are the times the
work was issued (the Statistics from CUDA events hold the kernel times).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["TraceRecorder", "LANES", "trace_path", "prepare_trace_folder", "claim_trace_path"]

LANES = ("compute", "comm", "wait")
FORMAT, VERSION = "scaleout-trace", 2
_UPDATE = "update "  # an update span's name: this, then the layers it updated joined by "+"

# How many models of this process claimed a file per (folder, rank) (claim_trace_path): one
# process may train several traced models (a GAN's two), and each writes its own file. Never
# reset: a name once claimed stays its model's, so a model built after another was closed
# does not overwrite that one's trace either (per process state: nothing for a test to reset,
# each uses its own folder).
_claims: dict[tuple[str, int], int] = {}
_claims_lock = threading.Lock()


def trace_path(folder: str | os.PathLike, rank: int, model: int = 0) -> str:
    """The file rank ``rank`` writes in ``folder``: ``trace.<rank>.json`` for the first traced
    model of its process, ``trace.<rank>.<model>.json`` for the later ones (model 1, 2...)."""
    name = f"trace.{rank}.json" if model == 0 else f"trace.{rank}.{model}.json"
    return os.path.join(os.fspath(folder), name)


def prepare_trace_folder(folder: str | os.PathLike, *, setting: str) -> str:
    """Create ``folder`` if needed and check that it takes files, when the model is built
    rather than when the trace is written after the whole run; its absolute path.

    Args:
        folder: the trace folder.
        setting: where it came from, for the error (``"trace="``, ``"SCALEOUT_TRACE"``).

    Raises:
        ValueError: ``folder`` is not a folder, cannot be created or is not writable.
    """
    path = os.path.abspath(os.fspath(folder))
    if os.path.exists(path) and not os.path.isdir(path):
        reason = "it exists and is not a folder"
    else:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise ValueError(f"trace folder {path!r} (from {setting}) cannot be created: "
                             f"{err.strerror or err}") from err
        reason = "" if os.access(path, os.W_OK | os.X_OK) else "it is not writable"
    if reason:
        raise ValueError(f"trace folder {path!r} (from {setting}) cannot hold traces: {reason}")
    return path


def claim_trace_path(folder: str | os.PathLike, rank: int) -> str:
    """The file the next traced model of this process writes for rank ``rank`` in ``folder``
    (:func:`trace_path`; models claim in the order they are built, alike on every rank)."""
    key = (os.path.abspath(os.fspath(folder)), rank)
    with _claims_lock:
        model = _claims.get(key, 0)
        _claims[key] = model + 1
    return trace_path(folder, rank, model)


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
        self._iteration = 0  # the iteration in progress (= iterations ended)
        self._grads = 0  # the iteration of the last backward: its gradients are in flight
        self._forward: dict[str, float] = {}  # the last forward's seconds per layer...
        self._forward_batch: int | None = None  # ...and batch, until a backward follows
        # forward order of first appearance; *_s: iteration -> summed seconds
        self._layers: dict[str, dict[str, Any]] = {}
        self.batch_size = 1  # samples per rank of the last forward a backward followed

    def now(self) -> float:
        return time.perf_counter()

    def begin_forward(self, batch_size: int | None = None) -> None:
        """A forward starts: the previous one's samples are dropped if no backward followed
        it (an evaluation forward; a ``no_sync()`` micro-batch, whose backward is untimed)."""
        with self._lock:
            self._forward = {}
            self._forward_batch = batch_size

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        """Log a span; ``start``/``end`` are ``time.perf_counter()`` values.

        ``args`` may carry ``phase`` (``forward``/``backward``/``update``) for compute spans
        and ``bytes``, ``codec``, ``priority_lane`` for communication.
        """
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        phase = args.get("phase") if lane == "compute" else None
        with self._lock:
            if phase == "backward":
                self._backward_began()
            # forward and backward: this step's; the rest: the gradients of the last backward
            iteration = self._iteration if phase in ("forward", "backward") else self._grads
            self._events.append({"lane": lane, "name": name, "start": start - self._t0,
                                 "end": end - self._t0, "iteration": iteration, **args})
            if phase == "forward":
                self._forward[name] = self._forward.get(name, 0.0) + (end - start)
            elif phase == "backward":
                self._add(name, "backward_s", end - start)
            elif phase == "update":
                self._add_update(name, end - start)

    def _backward_began(self) -> None:
        """A backward span came: the forward before it counts (its samples and batch), and
        the gradients in flight from now on are this iteration's."""
        for layer, seconds in self._forward.items():
            self._add(layer, "forward_s", seconds)
        if self._forward_batch is not None:
            self.batch_size = self._forward_batch
        self._forward, self._forward_batch = {}, None
        self._grads = self._iteration

    def _add(self, layer: str, key: str, seconds: float, iteration: int | None = None) -> None:
        """Add ``seconds`` to ``layer``'s ``key`` sample of ``iteration`` (default: the one in
        progress): one sample per iteration, the sum of its spans."""
        sums = self._layer(layer)[key]
        at = self._iteration if iteration is None else iteration
        sums[at] = sums.get(at, 0.0) + seconds

    def _add_update(self, name: str, seconds: float) -> None:
        """Split an update span's ``seconds`` over the layers it names, by their gradient
        bytes (evenly when none are known), into the last backward's iteration."""
        layers = self._updated_layers(name)
        weights = [self._layers[layer]["grad_bytes"] for layer in layers]
        total = sum(weights)
        for layer, weight in zip(layers, weights):
            share = weight / total if total else 1.0 / len(layers)
            self._add(layer, "update_s", seconds * share, self._grads)

    def _updated_layers(self, name: str) -> list[str]:
        """The known layers an update span named ``update a+b`` updated (a layer's own name
        may hold a ``+``: pieces are joined until they name a known layer)."""
        found: list[str] = []
        part = ""
        for piece in name.removeprefix(_UPDATE).split("+"):
            part = f"{part}+{piece}" if part else piece
            if part in self._layers:
                found.append(part)
                part = ""
        return found

    def set_grad_bytes(self, layer: str, nbytes: int) -> None:
        """The bytes of ``layer``'s gradients (its parameters' sizes)."""
        with self._lock:
            self._layer(layer)["grad_bytes"] = int(nbytes)

    def _layer(self, name: str) -> dict[str, Any]:
        """``name``'s per-layer record (made on first sight: forward order)."""
        return self._layers.setdefault(name, {"name": name, "forward_s": {}, "backward_s": {},
                                              "update_s": {}, "grad_bytes": 0})

    def end_iteration(self) -> None:
        """The iteration in progress ended (DataParallel: at the end of its backward)."""
        with self._lock:
            self._iteration += 1

    def to_dict(self, *, workload: str = "model", batch_size: int | None = None,
                device: str = "cpu", command: str = "") -> dict[str, Any]:
        """The trace (simulator format, plus ``rank`` and ``events``)."""
        with self._lock:
            layers = [_samples(layer) for layer in self._layers.values()
                      if layer["forward_s"] and layer["backward_s"]]
            events = list(self._events)
            iterations, recorded_batch = self._iteration, self.batch_size
        return {"format": FORMAT, "version": VERSION, "workload": workload,
                "batch_size": batch_size or recorded_batch, "device": device,
                "command": command, "rank": self.rank, "iterations": iterations,
                "layers": layers, "events": events}

    def write(self, path: str | os.PathLike, **meta: Any) -> str:
        """Write the trace to ``path`` (its folder made again if it went since
        :func:`prepare_trace_folder`) through a temporary file, so a reader never sees half
        of it; ``path``."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(**meta), f)
        os.replace(tmp, path)
        return path


def _samples(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer record as the file holds it: per-iteration samples in iteration order
    (``update_s`` only when an update was recorded: the simulator then reads 0)."""
    record = {**layer, **{key: list(layer[key].values())
                          for key in ("forward_s", "backward_s", "update_s")}}
    if not record["update_s"]:
        del record["update_s"]
    return record
