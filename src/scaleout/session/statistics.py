"""Per-operation timing and traffic: compute, communication and exposed time, bytes."""

from __future__ import annotations

import threading
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
        iterations: iterations ended in which it reported a figure (before stop 48: always
            0; until stop 52 every iteration since its first report, skipped ones too).
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
        self._ops: dict[str, OperationStats] = {}
        self._reported: set[str] = set()  # operations with a figure in the current iteration
        self._lock = threading.Lock()  # the progress engine adds from its own thread
        self.iterations = 0
        self.trace = trace

    def add(self, operation: str, **amounts: float) -> None:
        """Add ``amounts`` (field=value) to ``operation``'s figures."""
        self.add_shared(((operation, 1.0),), **amounts)

    def add_shared(self, shares: Sequence[tuple[str, float]], **amounts: float) -> None:
        """Add ``amounts`` to several operations, each its share (a bucket's members, by
        size), under one lock (the progress engine does this per bucket and iteration).
        Integer amounts (bytes) are split into integers that add up to the amount."""
        with self._lock:
            for key, value in amounts.items():
                for (operation, _), part in zip(shares, _split(value, shares)):
                    stats = self._ops.setdefault(operation, OperationStats())
                    setattr(stats, key, getattr(stats, key) + part)
                    self._reported.add(operation)

    def end_iteration(self) -> None:
        """A training iteration ended: DataParallel calls it at the end of each backward that
        exchanged gradients, so per-iteration figures are per training step (a forward
        without backward, as in evaluation, or a ``no_sync()`` micro-batch is none)."""
        with self._lock:  # (each operation's count: the iterations it reported in)
            self.iterations += 1
            for name in self._reported:
                self._ops[name].iterations += 1
            self._reported.clear()
        if self.trace is not None:
            self.trace.end_iteration()

    def reset(self) -> None:
        with self._lock:
            self._ops.clear()
            self._reported.clear()
            self.iterations = 0

    def __contains__(self, name: object) -> bool:
        """Whether operation ``name`` has reported any figure."""
        return name in self._ops

    def operation(self, name: str) -> OperationStats:
        """``name``'s figures.

        Raises:
            KeyError: no operation of that name has reported (before stop 52 a mistyped name
                silently gave a row of zeros, and added it to the table).
        """
        try:
            return self._ops[name]
        except KeyError:
            known = ", ".join(repr(n) for n in self._ops) or "none yet"
            raise KeyError(f"no operation {name!r} in these statistics; known: {known}") from None

    def _snapshot(self) -> list[tuple[str, OperationStats]]:
        """The operations, listed under the lock: the progress thread may add one meanwhile
        (iterating the dict itself could fail, "dictionary changed size during iteration")."""
        with self._lock:
            return list(self._ops.items())

    def total(self) -> OperationStats:
        total = OperationStats(iterations=self.iterations)
        for _, stats in self._snapshot():
            for key in ("compute_s", "backward_s", "comm_s", "exposed_s", "bytes", "raw_bytes"):
                setattr(total, key, getattr(total, key) + getattr(stats, key))
        return total

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{operation: {field: value}}`` plus ``"total"``; values summed over iterations."""
        result = {name: dict(vars(stats)) for name, stats in self._snapshot()}
        result["total"] = dict(vars(self.total()))
        return result

    def table(self, per_iteration: bool = True) -> str:
        """A readable table (per-iteration averages by default; totals, said so in its title,
        while no iteration has ended: a Session driven directly calls :meth:`end_iteration`
        after each step. Before stop 51 such a table gave the totals of every step under
        "per iteration, 0 iterations").

        Each operation's row is per iteration *it* reported in (its ``iterations``, the table's
        last column; one not yet ended counts as one), the total's per iteration of the run, so
        the rows of an operation added later or skipped in some iterations need not add up to
        the total. Before stop 52 every row was divided by the run's iterations: an operation
        that ran in 1 of 4 iterations showed a quarter of what it takes when it runs."""
        per_iteration = per_iteration and self.iterations > 0
        rows = []
        for name, stats in [*self._snapshot(), ("total", self.total())]:
            scale = 1.0 / max(stats.iterations, 1) if per_iteration else 1.0
            ratio = stats.raw_bytes / stats.bytes if stats.bytes else 0.0
            rows.append([name, f"{stats.compute_s * scale * 1e3:.1f}",
                         f"{stats.comm_s * scale * 1e3:.1f}", f"{stats.exposed_s * scale * 1e3:.1f}",
                         f"{stats.bytes * scale / 1e6:.2f}", f"{ratio:.1f}x" if ratio else "-",
                         stats.iterations])
        unit = ("per iteration" if per_iteration else
                "total" if self.iterations else "total: no end_iteration() yet")
        headers = ["operation", "compute ms", "comm ms", "exposed ms", "MB",
                   "compression", "iterations"]
        return f"Statistics ({unit}, {self.iterations} iterations)\n" + format_table(headers, rows)


def _split(value: float, shares: Sequence[tuple[str, float]]) -> list[float]:
    """``value`` in proportion to ``shares`` (which add up to one). An int is split into
    ints that add up to it: each part is its rounded running total less the one before
    (before stop 51 the parts were ``value * share``, floats: a bucket of 1,283 elements
    gave its 700-element member 8399.999999999998 bytes of 8,400)."""
    if not isinstance(value, int):
        return [value if share == 1.0 else value * share for _, share in shares]
    parts, done, running = [], 0, 0.0
    for _, share in shares:
        running += share
        upto = min(round(value * running), value)
        parts.append(upto - done)
        done = upto
    parts[-1] += value - done  # (running shares may miss one by a rounding error)
    return parts
