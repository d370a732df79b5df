"""Scaling efficiency: the same per-rank workload on a growing machine (weak scaling).

Example:
    >>> from scaleout.sim.network import parse_topology
    >>> from scaleout.sim.workload import Layer, Workload
    >>> w = Workload(name="t", layers=(Layer(name="a", forward_s=1, backward_s=2, grad_bytes=0),))
    >>> [round(p.efficiency, 2) for p in sweep(w, parse_topology("8", bandwidths=[1e9]), [1, 8])]
    [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scaleout.sim.config import IterationConfig
from scaleout.sim.iteration import IterationResult, simulate
from scaleout.sim.network import Topology
from scaleout.sim.workload import Workload

__all__ = ["Point", "sweep", "relative_efficiency"]


@dataclass(frozen=True, kw_only=True)
class Point:
    """One node count: its iteration and its efficiency against one rank that never waits."""

    npus: int
    result: IterationResult

    @property
    def efficiency(self) -> float:
        """Compute / iteration time at this size."""
        return self.result.efficiency


def sweep(
    workload: Workload,
    topology: Topology,
    npus: Sequence[int],
    config: IterationConfig | None = None,
) -> list[Point]:
    """Simulate ``workload`` on ``topology`` resized (:meth:`Topology.with_npus`) to each count.

    Raises:
        ValueError: an empty list or a count < 1.
    """
    if not npus or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in npus):
        raise ValueError(f"npus must be a non-empty list of ints >= 1, got {npus!r}")
    return [Point(npus=n, result=simulate(workload, topology.with_npus(n), config)) for n in npus]


def relative_efficiency(
    workload: Workload,
    topology: Topology,
    base: int,
    target: int,
    config: IterationConfig | None = None,
) -> float:
    """Weak-scaling efficiency from ``base`` to ``target`` NPUs: ``T(base) / T(target)``."""
    low, high = sweep(workload, topology, [base, target], config)
    return low.result.iteration_s / high.result.iteration_s
