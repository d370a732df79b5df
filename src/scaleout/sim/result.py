"""What a simulated iteration returns: its steady state and, on request, its timeline."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Span", "IterationResult"]


@dataclass(frozen=True)
class Span:
    """Something that took time: ``lane`` is ``"compute"``, ``"comm"`` or ``"wait"``."""

    lane: str
    name: str
    start: float
    end: float
    iteration: int


@dataclass(frozen=True, kw_only=True)
class IterationResult:
    """The steady-state iteration.

    Attributes:
        workload: its name.
        npus: ranks.
        iteration_s: seconds per iteration.
        compute_s: one rank's compute per iteration.
        exposed_s: ``iteration_s - compute_s``: communication the compute waited for.
        comm_s: network seconds per iteration (all chunks).
        efficiency: ``compute_s / iteration_s`` (weak scaling against one rank).
        utilisation: per dimension, link busy time / iteration time.
        buckets, chunks: of the plan.
        spans: every span when ``trace`` was asked for, else empty.
    """

    workload: str
    npus: int
    iteration_s: float
    compute_s: float
    exposed_s: float
    comm_s: float
    efficiency: float
    utilisation: tuple[float, ...]
    buckets: int
    chunks: int
    spans: tuple[Span, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready fields (spans left out)."""
        names = ("workload", "npus", "iteration_s", "compute_s", "exposed_s", "comm_s",
                 "efficiency", "buckets", "chunks")
        return {**{k: getattr(self, k) for k in names}, "utilisation": list(self.utilisation)}
