"""What the autotuner chose and why: :class:`Candidate` (one priced configuration) and
:class:`TuneChoice` (the choice, its reasons, the candidates, a runner-up), made by
:func:`scaleout.sim.tuning.choose`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scaleout.scheduler.config import SchedulerConfig
from scaleout.sim.link import LinkModel
from scaleout.sim.units import format_bytes, format_time

__all__ = ["Candidate", "TuneChoice"]


@dataclass(frozen=True)
class Candidate:
    """One priced configuration: a label, its scheduler, its codecs, the predicted iteration."""

    label: str
    scheduler: SchedulerConfig
    codecs: Mapping[str, str]
    predicted_s: float


@dataclass(frozen=True, kw_only=True)
class TuneChoice:
    """What the tuner chose and why.

    Attributes:
        scheduler: the chosen scheduling options.
        codecs: layer name -> codec spec for the layers that travel compressed (empty: exact).
        predicted_s: predicted seconds per iteration of the choice.
        default_s: predicted seconds per iteration with the default options, exact.
        exact_s: of the best exact configuration.
        compute_s: the measured compute per iteration (the floor).
        link: the measured link.
        reasons: one line per decision.
        candidates: the configurations priced on the way, best first.
        runner_up: a lossy configuration with other codecs (on at least half the bytes either
            compresses) predicted within ``runner_up_within`` of the chosen one, to be timed
            beside it; ``None``: none.
    """

    scheduler: SchedulerConfig
    codecs: Mapping[str, str]
    predicted_s: float
    default_s: float
    exact_s: float
    compute_s: float
    link: LinkModel
    reasons: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    runner_up: Candidate | None = None

    def key(self) -> tuple[Any, ...]:
        """What must be equal on every rank (the configuration itself, and its runner-up)."""
        runner = self.runner_up
        return (self.scheduler, tuple(sorted(self.codecs.items())),
                runner and (runner.scheduler, tuple(sorted(runner.codecs.items()))))

    def summary(self, top: int = 6) -> str:
        """A readable report: what was chosen, why, and the best candidates' predictions."""
        s = self.scheduler
        specs = list(self.codecs.values())
        codecs = ", ".join(f"{spec} on {specs.count(spec)} layers" for spec in sorted(set(specs)))
        lines = [
            f"link: {self.link.describe()}; compute {format_time(self.compute_s)}/it",
            f"chosen: policy={s.policy or 'default'} bucket={format_bytes(s.bucket_bytes)} "
            f"first_bucket={format_bytes(s.first_bucket_bytes)} "
            f"chunk={format_bytes(s.partition_bytes)} credit={format_bytes(s.credit_bytes)} "
            f"urgent={format_bytes(s.urgent_bytes)}; codecs: "
            + (codecs or "none (exact)"),
            f"predicted per iteration: chosen {format_time(self.predicted_s)}, best exact "
            f"{format_time(self.exact_s)}, defaults {format_time(self.default_s)}",
            *(f"why: {reason}" for reason in self.reasons),
            *([f"runner-up: {format_time(self.runner_up.predicted_s)}  {self.runner_up.label}"]
              if self.runner_up else []),
            "candidates (the best of each kind, best first):",
            *(f"  {format_time(c.predicted_s):>10}  {c.label}" for c in self.best_of_each()[:top]),
        ]
        return "\n".join(lines)

    def best_of_each(self) -> list[Candidate]:
        """The best candidate of each kind (defaults, exact, each codec assignment)."""
        seen, out = set(), []
        for cand in self.candidates:
            kind = cand.label.split(",")[0].split(":")[0] if cand.codecs or \
                cand.label.startswith("defaults") else "exact"
            if kind not in seen:
                seen.add(kind)
                out.append(cand)
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"scheduler": vars(self.scheduler).copy(), "codecs": dict(self.codecs),
                "predicted_s": self.predicted_s, "default_s": self.default_s,
                "exact_s": self.exact_s, "compute_s": self.compute_s,
                "link": vars(self.link).copy(), "reasons": list(self.reasons),
                "candidates": [{"label": c.label, "predicted_s": c.predicted_s}
                               for c in self.candidates],
                "runner_up": self.runner_up and {"label": self.runner_up.label,
                                                 "codecs": dict(self.runner_up.codecs),
                                                 "predicted_s": self.runner_up.predicted_s}}
