"""Whether each configuration of a ``bench train`` run trained what it should.

Every rank of every configuration digests its parameters after each round
(:mod:`scaleout.bench.train_digest`); from rank 0's results this module checks, round by
round (warm ranks keep training from round to round, and every configuration takes the same
steps, so configurations compare within a round):

* **replicas**: the ranks of a configuration that trains hold the same parameters, within
  :data:`REPLICA_TOLERANCE`;
* **exact**: a configuration that trains with exact gradients (``scaleout``,
  ``scaleout+auto-exact``, ``scaleout-sharded``, ``ddp``, ``ddp-tuned[:MB]``, ``zero``, the
  ``hybrid`` variants) holds, after the same steps on the same batches from the same seed,
  the parameters of the reference (``ddp`` when it ran, else the first exact one) within
  :data:`EXACT_TOLERANCE`: float reordering (bucket layouts, reduction orders) differs by
  less;
* **lossy** ones (``scaleout+SPEC``, ``scaleout+auto``, ``ddp-fp16``, ``ddp-powersgd``):
  their distance to the reference is reported, never judged.

``single``, ``lockstep``, ``lockstep-traffic`` and ``hybrid-lockstep`` are not data-parallel
trainers (one rank alone, or every rank its own copy) and are not checked.

The distance of two digests estimates ``||A - B|| / ||movement||``: how far apart two
models are, over how far training moved them from their common start. For each parameter,
``||A - B||`` is estimated from the random projections of the movements (the root mean
square of their differences), and bounded from below by the differences of the sums and
sums of squares (Cauchy-Schwarz: these catch models that started apart); the larger is
summed in quadrature over the parameters and divided by the norm of the movement. Two runs
that train differently (a rank stepping on its own gradient) differ by about as much as they
moved: distances of 0.1 to 1; a bf16 gradient codec moves a model by ~1e-3 of that.

A configuration faster than its ceiling (``lockstep``; ``hybrid-lockstep`` for the hybrid
ones) beyond the rounds' spread (its slowest round faster than the ceiling's fastest, by
more than :data:`SUSPECT_MARGIN`) is reported as suspect: no synchronous data-parallel run
can be.

Example (digests of one parameter of 4 values, with 2 projections):
    >>> a = {"w": [4, 2.0, 1.0, 0.4, 0.04, 0.1, -0.1]}
    >>> distance(a, a)
    (0.0, None)
    >>> round(distance(a, {"w": [4, 2.0, 1.0, 0.4, 0.04, 0.12, -0.08]})[0], 3)  # 0.02 / 0.2
    0.1
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from scaleout.bench.train_config import split_variant

__all__ = ["EXACT_TOLERANCE", "REPLICA_TOLERANCE", "SUSPECT_MARGIN", "CEILING_OF",
           "check_rounds", "distance", "is_exact", "suspects", "trains"]

#: Largest distance (of the movement) between an exact configuration and the reference.
EXACT_TOLERANCE = 1e-3
#: Largest distance between the ranks of one configuration (they apply the same update).
REPLICA_TOLERANCE = 1e-5
#: How much faster than its ceiling's fastest round a configuration's slowest may be.
SUSPECT_MARGIN = 0.02
#: Configurations that are not data-parallel trainers: no digests to judge.
NOT_TRAINERS = ("single", "lockstep", "lockstep-traffic", "hybrid-lockstep")
#: The ceiling each kind of configuration is held against (by name prefix, first match).
CEILING_OF = (("hybrid", "hybrid-lockstep"), ("", "lockstep"))
#: The reference's preference order (then any exact configuration, in the run's order).
REFERENCES = ("ddp", "ddp-tuned", "zero")

Digest = Mapping[str, Sequence[float]]


def trains(name: str) -> bool:
    """Whether configuration ``name`` trains one model over its ranks (and is checked)."""
    return name not in NOT_TRAINERS


def is_exact(name: str) -> bool:
    """Whether configuration ``name`` trains with exact gradients (``ddp``'s parameters, up
    to float reordering); the others are lossy or not trainers."""
    base, spec = split_variant(name)
    if not trains(name):
        return False
    if base == "scaleout":
        return spec in (None, "none", "auto-exact")
    return name not in ("ddp-fp16", "ddp-powersgd")


def _bounds(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(estimate of ``||A - B||`` for one parameter, the larger movement's norm)."""
    n = max(a[0], 1)
    moved = math.sqrt(max(a[4], b[4], 0.0))
    size = math.sqrt(max(a[2], b[2], 0.0))
    projections = [x - y for x, y in zip(a[5:], b[5:])]
    bounds = [abs(a[1] - b[1]) / math.sqrt(n), abs(a[3] - b[3]) / math.sqrt(n)]
    if projections:
        bounds.append(math.sqrt(sum(d * d for d in projections) / len(projections)))
    if moved > 0:  # |A.A - B.B| = |(A - B).(A + B)| <= ||A - B|| * 2 max(||A||, ||B||)
        bounds.append(abs(a[4] - b[4]) / (2 * moved))
    if size > 0:
        bounds.append(abs(a[2] - b[2]) / (2 * size))
    worst = max(bounds)
    return (worst if not math.isnan(worst) else math.inf), moved


def distance(a: Digest, b: Digest) -> tuple[float, str | None]:
    """How far apart two digests are, over how far training moved (the module doc), and the
    parameter that differs most (``None`` when none differs); ``inf`` when they name
    different parameters or shapes."""
    if set(a) != set(b):
        odd = sorted(set(a) ^ set(b))
        return math.inf, odd[0]
    apart = moved = 0.0
    worst, worst_name = 0.0, None
    for name in a:
        if a[name][0] != b[name][0]:
            return math.inf, name
        bound, norm = _bounds(a[name], b[name])
        apart += bound * bound
        moved += norm * norm
        if bound > worst:
            worst, worst_name = bound, name
    if apart == 0:
        return 0.0, None
    if math.isinf(apart) or moved == 0:
        return math.inf, worst_name
    return math.sqrt(apart / moved), worst_name


def _replicas(digests: Sequence[Digest]) -> tuple[float, str | None]:
    """How far the ranks' parameters are apart (the largest distance to rank 0's), and the
    parameter that differs most."""
    apart, where = 0.0, None
    for other in digests[1:]:
        gap, name = distance(digests[0], other)
        if gap > apart:
            apart, where = gap, name
    return apart, where


def _reference(names: Sequence[str], whole: Mapping[str, Any],
               replicas: Mapping[str, float]) -> str | None:
    """The configuration the exact ones are held against: ``ddp``, else the first exact one
    (in :data:`REFERENCES`' order, then the run's) whose replicas agree."""
    candidates = [n for n in (*REFERENCES, *names) if n in whole and is_exact(n)]
    good = [n for n in candidates if replicas[n] <= REPLICA_TOLERANCE]
    return good[0] if good else None


def check_round(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Verdicts for one round: ``{configuration: verdict}``, each with ``replicas`` (the
    ranks' distance), ``exact``, ``reference`` and ``distance`` (to it; ``None`` for the
    reference itself or without one), ``steps`` and ``wrong`` (what failed; empty: right)."""
    whole, replicas, where, steps = {}, {}, {}, {}
    for name, run in runs.items():
        if trains(name) and run.get("digests"):
            whole[name] = run["digests"][0]
            replicas[name], where[name] = _replicas(run["digests"])
            steps[name] = run.get("steps")
    reference = _reference(list(runs), whole, replicas)
    verdicts: dict[str, dict[str, Any]] = {}
    for name in whole:
        wrong = []
        if replicas[name] > REPLICA_TOLERANCE:
            wrong.append(f"its ranks' parameters differ: distance {replicas[name]:.3g} of the "
                         f"movement (tolerance {REPLICA_TOLERANCE:g}), most in {where[name]}")
        gap, most = (None, None)
        if reference is not None and name != reference:
            if steps[name] != steps[reference]:
                wrong.append(f"it took {steps[name]} steps, {reference} {steps[reference]}")
            else:
                gap, most = distance(whole[name], whole[reference])
                if is_exact(name) and gap > EXACT_TOLERANCE:
                    wrong.append(f"its parameters differ from {reference}'s: distance {gap:.3g} "
                                 f"of the movement (tolerance {EXACT_TOLERANCE:g}), most in "
                                 f"{most}")
        verdicts[name] = {"exact": is_exact(name), "replicas": replicas[name],
                          "reference": reference, "distance": gap, "most_apart": most,
                          "steps": steps[name], "wrong": wrong}
    return verdicts


def check_rounds(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Check every round of ``runs`` (:func:`run_benchmark`'s); each run is given its
    round's verdict as ``check``. Returns per configuration: the largest ``replicas`` and
    ``distance`` over rounds, ``exact``, ``reference`` and ``wrong`` (every reason, with
    its round)."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        if "error" not in run:
            rounds.setdefault(run["round"], {})[run["config"]] = run
    summary: dict[str, dict[str, Any]] = {}
    for index in sorted(rounds):
        for name, verdict in check_round(rounds[index]).items():
            rounds[index][name]["check"] = verdict
            entry = summary.setdefault(name, {"exact": verdict["exact"], "replicas": 0.0,
                                              "reference": verdict["reference"],
                                              "distance": None, "wrong": []})
            entry["replicas"] = max(entry["replicas"], verdict["replicas"])
            if verdict["distance"] is not None:
                entry["distance"] = max(entry["distance"] or 0.0, verdict["distance"])
            entry["wrong"] += [f"round {index}: {why}" for why in verdict["wrong"]]
    return summary


def suspects(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Warning lines for the configurations faster than their ceiling beyond the rounds'
    spread (the module doc); ``summary`` as :func:`scaleout.bench.train_report.summarize`'s."""
    lines = []
    for name, entry in summary.items():
        if not trains(name):
            continue
        ceiling = next(c for prefix, c in CEILING_OF if name.startswith(prefix))
        mine = entry.get("throughput_per_round") or []
        theirs = (summary.get(ceiling) or {}).get("throughput_per_round") or []
        if mine and theirs and min(mine) > max(theirs) * (1 + SUSPECT_MARGIN):
            lines.append(f"{name} ran faster than its ceiling {ceiling} in every round (its "
                         f"slowest {min(mine):.1f} samples/s, {ceiling}'s fastest "
                         f"{max(theirs):.1f}): no synchronous data-parallel run can; check "
                         "that it trains what it should")
    return lines
