"""Per-operation timing and traffic: compute, communication and exposed time, bytes."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scaleout.table import format_table

__all__ = ["Statistics", "OperationStats"]


@dataclass
class OperationStats:
    """Accumulated figures of one operation (seconds and bytes, summed over iterations).

    Attributes:
        compute_s: time in the operation's own forward and backward computation.
        backward_s: the part of ``compute_s`` spent in backward.
        comm_s: time its gradient communication was in flight (issue to completion).
        exposed_s: time the training loop was blocked waiting for that communication.
        bytes: payload bytes handed to collectives for it (after compression).
        raw_bytes: bytes it would have sent uncompressed.
        iterations: iterations ended since it first reported (before stop 48: always 0).
    """

    compute_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    bytes: int = 0
    raw_bytes: int = 0
    iterations: int = 0


class Statistics:
    """Figures per operation, a total, a printable table and a dict.

    Args:
        trace: a :class:`~scaleout.session.trace.TraceRecorder` that the places timing
            things for these statistics also log their spans to (``None``: no trace).
    """

    def __init__(self, trace: Any = None) -> None:
        self._ops: dict[str, OperationStats] = defaultdict(OperationStats)
        self._lock = threading.Lock()  # the progress engine adds from its own thread
        self.iterations = 0
        self.trace = trace

    def add(self, operation: str, **amounts: float) -> None:
        """Add ``amounts`` (field=value) to ``operation``'s figures."""
        self.add_shared(((operation, 1.0),), **amounts)

    def add_shared(self, shares: Sequence[tuple[str, float]], **amounts: float) -> None:
        """Add ``amounts`` to several operations, each its share (a bucket's members, by
        size), under one lock (the progress engine does this per bucket and iteration)."""
        with self._lock:
            for operation, share in shares:
                stats = self._ops[operation]
                for key, value in amounts.items():
                    part = value if share == 1.0 else value * share  # (ints stay ints)
                    setattr(stats, key, getattr(stats, key) + part)

    def end_iteration(self) -> None:
        """A training iteration ended: DataParallel calls it at the end of each backward that
        exchanged gradients, so per-iteration figures are per training step (a forward
        without backward, as in evaluation, or a ``no_sync()`` micro-batch is none)."""
        with self._lock:  # (each operation's count: the iterations since it first reported)
            self.iterations += 1
            for stats in self._ops.values():
                stats.iterations += 1
        if self.trace is not None:
            self.trace.end_iteration()

    def reset(self) -> None:
        self._ops.clear()
        self.iterations = 0

    def operation(self, name: str) -> OperationStats:
        return self._ops[name]

    def total(self) -> OperationStats:
        total = OperationStats(iterations=self.iterations)
        for stats in self._ops.values():
            for key in ("compute_s", "backward_s", "comm_s", "exposed_s", "bytes", "raw_bytes"):
                setattr(total, key, getattr(total, key) + getattr(stats, key))
        return total

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{operation: {field: value}}`` plus ``"total"``; values summed over iterations."""
        result = {name: dict(vars(stats)) for name, stats in self._ops.items()}
        result["total"] = dict(vars(self.total()))
        return result

    def table(self, per_iteration: bool = True) -> str:
        """A readable table (per-iteration averages by default)."""
        scale = 1.0 / max(self.iterations, 1) if per_iteration else 1.0
        rows = []
        for name, stats in [*self._ops.items(), ("total", self.total())]:
            ratio = stats.raw_bytes / stats.bytes if stats.bytes else 0.0
            rows.append([name, f"{stats.compute_s * scale * 1e3:.1f}",
                         f"{stats.comm_s * scale * 1e3:.1f}", f"{stats.exposed_s * scale * 1e3:.1f}",
                         f"{stats.bytes * scale / 1e6:.2f}", f"{ratio:.1f}x" if ratio else "-"])
        unit = "per iteration" if per_iteration else "total"
        headers = ["operation", "compute ms", "comm ms", "exposed ms", "MB",
                   "compression"]
        return f"Statistics ({unit}, {self.iterations} iterations)\n" + format_table(headers, rows)
