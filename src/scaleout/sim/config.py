"""How a simulated iteration runs: scheduling, overlap mode, collective algorithm, codec."""

from __future__ import annotations

from dataclasses import dataclass, field

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.collectives import ALGORITHMS

__all__ = ["MODES", "CodecModel", "IterationConfig"]

MODES = ("sync", "overlap")


@dataclass(frozen=True, kw_only=True)
class CodecModel:
    """A codec as the simulator sees it: how much it shrinks and what it costs.

    Attributes:
        name: ``""`` for exact gradients (then ``ratio`` must be 1).
        ratio: wire bytes / gradient bytes.
        seconds_per_byte: encode + decode compute per gradient byte (measured, e.g.
            docs/compression.md).
        summable: payloads add on the wire (all-reduce); else they are all-gathered.
    """

    name: str = ""
    ratio: float = 1.0
    seconds_per_byte: float = 0.0
    summable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.ratio, (int, float)) or not 0 < self.ratio <= 1:
            raise ValueError(f"codec ratio must be in (0, 1], got {self.ratio!r}")
        if not isinstance(self.seconds_per_byte, (int, float)) or self.seconds_per_byte < 0:
            raise ValueError(f"codec seconds_per_byte must be >= 0, got {self.seconds_per_byte!r}")
        if not self.name and (self.ratio != 1 or self.seconds_per_byte or not self.summable):
            raise ValueError("an exact codec (name '') has ratio 1, no cost and is summable")


@dataclass(frozen=True, kw_only=True)
class IterationConfig:
    """How the iteration is run.

    Attributes:
        scheduler: the runtime's scheduling options (policy, buckets, chunks, credit).
        mode: ``"overlap"`` (scaleout's cross-iteration overlap) or ``"sync"`` (DDP).
        algorithm: collective algorithm, or one per dimension.
        flat: one ring over all NPUs instead of the hierarchical decomposition.
        codec: the codec's byte ratio and cost.
        iterations: simulated back to back (>= 3); the steady state is reported.
        trace: keep every span for a Chrome trace.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mode: str = "overlap"
    algorithm: str | tuple[str, ...] = "ring"
    flat: bool = False
    codec: CodecModel = field(default_factory=CodecModel)
    iterations: int = 3
    trace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError(
                f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        names = (self.algorithm,) if isinstance(self.algorithm, str) else tuple(self.algorithm)
        if not names or any(a not in ALGORITHMS for a in names):
            raise ValueError(f"algorithm must be from {ALGORITHMS}, got {self.algorithm!r}")
        if (
            isinstance(self.iterations, bool)
            or not isinstance(self.iterations, int)
            or self.iterations < 3
        ):
            raise ValueError(f"iterations must be an int >= 3, got {self.iterations!r}")
