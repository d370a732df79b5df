"""Validation that can fail: predicted vs measured, each reference number with its source.

A :class:`Scenario` knows its measured value, its source, the assumptions behind the
prediction, a bound on the error and how to predict. :func:`validate` runs scenarios and
reports each error and whether it is within its bound; ``scaleout sim validate`` prints the
table, writes the JSON and exits non-zero when any bound is exceeded. Groups of scenarios
live in :mod:`scaleout.sim.published` and :mod:`scaleout.sim.testbed_cases`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Scenario", "Outcome", "Report", "RELATIVE_UNITS", "validate"]

RELATIVE_UNITS = ("ms", "GB/s")  # errors relative to the measured value


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One reference point.

    Attributes:
        name: short label.
        group: ``"published"`` or ``"testbed"`` (groups have separate summaries).
        measured: the reference value.
        unit: ``"%"`` (efficiency points), ``"x"`` (a ratio), ``"ms"`` or ``"GB/s"``.
        bound: the largest accepted error: absolute in ``unit`` for ``%`` and ``x``, relative
            (fraction of measured) for ``ms`` and ``GB/s``.
        source: where ``measured`` comes from.
        assumptions: every assumption the prediction makes (rates, links, algorithm).
        predict: computes the prediction (no argument; everything is in the closure).
    """

    name: str
    group: str
    measured: float
    unit: str
    bound: float
    source: str
    assumptions: str
    predict: Callable[[], float]

    def __post_init__(self) -> None:
        if self.unit not in ("%", "x", *RELATIVE_UNITS):
            raise ValueError(f"unit must be '%', 'x', 'ms' or 'GB/s', got {self.unit!r}")
        if not self.bound > 0:
            raise ValueError(f"bound must be > 0, got {self.bound!r}")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A scenario's result: ``error`` is predicted - measured (relative for ms and GB/s)."""

    scenario: Scenario
    predicted: float
    error: float

    @property
    def ok(self) -> bool:
        """Whether ``|error|`` is within the scenario's bound."""
        return abs(self.error) <= self.scenario.bound

    def as_dict(self) -> dict:
        """JSON-ready: the scenario's fields, the prediction and the verdict."""
        s = self.scenario
        return {
            "scenario": s.name,
            "group": s.group,
            "measured": s.measured,
            "predicted": self.predicted,
            "unit": s.unit,
            "error": self.error,
            "bound": s.bound,
            "ok": self.ok,
            "source": s.source,
            "assumptions": s.assumptions,
        }


@dataclass(frozen=True, kw_only=True)
class Report:
    """All outcomes; ``ok`` when every bound (and every group's summary bound) holds."""

    outcomes: tuple[Outcome, ...]
    summaries: tuple[str, ...]
    ok: bool

    def as_dict(self) -> dict:
        """JSON-ready: the verdict, the group summaries and every outcome."""
        return {
            "ok": self.ok,
            "summaries": list(self.summaries),
            "outcomes": [o.as_dict() for o in self.outcomes],
        }

    def rows(self) -> list[list[str]]:
        """Table rows: scenario, measured, predicted, error, bound, verdict, source."""
        out = []
        for o in self.outcomes:
            s = o.scenario
            if s.unit in RELATIVE_UNITS:
                digits = 1 if s.unit == "ms" else 3
                fmt = [
                    f"{s.measured:.{digits}f}{s.unit}",
                    f"{o.predicted:.{digits}f}{s.unit}",
                    f"{o.error * 100:+.1f}%",
                    f"{s.bound * 100:.0f}%",
                ]
            elif s.unit == "%":
                fmt = [
                    f"{s.measured:.1f}%",
                    f"{o.predicted:.1f}%",
                    f"{o.error:+.1f}pt",
                    f"{s.bound:g}pt",
                ]
            else:
                fmt = [
                    f"{s.measured:.2f}x",
                    f"{o.predicted:.2f}x",
                    f"{o.error:+.2f}",
                    f"{s.bound:.2f}",
                ]
            out.append([s.name, *fmt, "ok" if o.ok else "FAIL", s.source])
        return out


def validate(scenarios: Sequence[Scenario], *, median_bound: float | None = 0.05) -> Report:
    """Predict every scenario and judge it.

    Args:
        scenarios: what to check.
        median_bound: for the ``testbed`` group, the largest accepted median absolute
            relative error (issue 13: 5%); ``None`` to skip. Other groups of relative errors
            (``collectives``) report their median without a bound on it.

    Returns:
        The :class:`Report`.
    """
    outcomes = []
    for s in scenarios:
        predicted = float(s.predict())
        relative = s.unit in RELATIVE_UNITS
        error = (predicted - s.measured) / s.measured if relative else predicted - s.measured
        outcomes.append(Outcome(scenario=s, predicted=predicted, error=error))
    ok = all(o.ok for o in outcomes)
    summaries = []
    for group in dict.fromkeys(o.scenario.group for o in outcomes):
        mine = [o for o in outcomes if o.scenario.group == group]
        line = f"{group}: {sum(o.ok for o in mine)}/{len(mine)} within bound"
        if all(o.scenario.unit in RELATIVE_UNITS for o in mine):
            median = statistics.median(abs(o.error) for o in mine)
            line += f"; median |error| {median * 100:.1f}%"
            if group == "testbed" and median_bound is not None:
                line += f" (bound {median_bound * 100:.0f}%)"
                ok = ok and median <= median_bound
        summaries.append(line)
    return Report(outcomes=tuple(outcomes), summaries=tuple(summaries), ok=ok)
