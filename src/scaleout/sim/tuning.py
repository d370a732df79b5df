"""Choosing a scheduling configuration (and codecs) by simulating the candidates.

The autotuner's engine: given one rank's measured per-layer compute (a :class:`Workload`),
a measured link (:class:`LinkModel`: an all-reduce of ``m`` bytes takes ``latency_s + m x
seconds_per_byte``) and, when lossy codecs are allowed, each layer's measured codec costs
(:class:`~scaleout.sim.config.CodecModel` per layer and spec), :func:`choose` prices
configurations with the iteration model (:func:`scaleout.sim.iteration.simulate`, the
runtime's own plan and policy objects) and returns the best as a :class:`TuneChoice`.

The search is deterministic (a pure function of its inputs), so ranks that agree on the
measurements agree on the choice. It is conservative: the defaults stay unless a change
is predicted to gain at least ``min_gain_exact``, and a lossy codec is chosen only where
it is predicted to gain at least ``min_gain_lossy`` over the best exact configuration. Where
an alternative is predicted within ``runner_up_within`` of the chosen one, it is named the
runner-up and the runtime times both (:mod:`scaleout.pytorch.tune_check`): for a lossy
choice another codec (on the transformer at 100 Mbit/s the model put PowerSGD 2% ahead of
top-k 1%; against the same peer PowerSGD measured 0.90x DDP's PowerSGD hook and top-k
1.20x; benchmarks/RESULTS.md), for an exact one the best configuration under the other
policy. The model serves one chunk at a time and does not price two lanes' exchanges running
at once on the cores the ranks compute on: on the transformer at 10 Gbit/s it put FIFO and
priority within 0.2-1.3% of each other, and with the policy forced FIFO measured 1.02x DDP
against priority's 0.93x (two pairs; RESULTS.md, stop 34).

Example:
    >>> from scaleout.sim.workload import Workload
    >>> w = Workload(name="toy", layers=tuple(Layer(name=f"l{i}", forward_s=0.01,
    ...     backward_s=0.02, grad_bytes=4 << 20) for i in range(4)))
    >>> link = LinkModel(ranks=2, latency_s=1e-4, seconds_per_byte=1 / 12.5e6)  # ~100 Mbit/s
    >>> choose(w, link).predicted_s <= choose(w, link).default_s
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from scaleout.scheduler.config import MB, POLICIES, SchedulerConfig
from scaleout.scheduler.plan import plan_and_policy
from scaleout.sim.config import MODES, CodecModel, IterationConfig
from scaleout.sim.iteration import plan_items, simulate
from scaleout.sim.link import LinkModel
from scaleout.sim.tune_choice import Candidate, TuneChoice
from scaleout.sim.units import format_bytes, format_time
from scaleout.sim.workload import Workload

__all__ = ["LinkModel", "Candidate", "TuneChoice", "choose", "SEARCH"]

KB = 1 << 10

#: The values the search tries for each scheduler field (credit: multiples of the chunk; never
#: one: the model serves chunks back to back, blind to the gap one chunk in flight leaves while
#: the engine sees it finish and issues the next: on dlrm at 10 Gbit/s it was 4.5% faster on
#: paper and 8-30% slower measured).
SEARCH: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "policy": POLICIES,
    "bucket_bytes": (1 * MB, 2 * MB, 4 * MB, 8 * MB, 16 * MB, 32 * MB, 64 * MB),
    "first_bucket_bytes": (256 * KB, 1 * MB, 4 * MB),
    "partition_bytes": (256 * KB, 512 * KB, 1 * MB, 2 * MB, 4 * MB, 8 * MB),
    "credit": (2, 4),
    "urgent_bytes": (256 * KB, 1 * MB, 4 * MB),
})


class _Search:
    """Prices configurations (memoised) for one workload, link and mode."""

    def __init__(self, workload: Workload, link: LinkModel, mode: str,
                 models: Mapping[str, Mapping[str, CodecModel]], codec_competes: bool) -> None:
        self.w, self.topo, self.mode, self.models = workload, link.topology(), mode, models
        self.cpu_per_message, self.cpu_per_byte = link.cpu_s_per_message, link.cpu_s_per_byte
        # with a CPU per byte the iteration model charges a codec's work to the compute's
        # cores itself (its share done while the rank computes, as the testbed's validated
        # model does): charged to the backward as well, it would count twice
        self.codec_competes = codec_competes and not link.cpu_s_per_byte
        self.priced: dict[tuple[Any, ...], Candidate] = {}

    def workload(self, codecs: Mapping[str, str]) -> Workload:
        """The workload, with each codec's work charged to its layer's backward as well when
        codecs compete with the compute for the same cores."""
        if not codecs or not self.codec_competes:
            return self.w
        return replace(self.w, layers=tuple(
            replace(layer, backward_s=layer.backward_s + layer.grad_bytes
                    * self.models[layer.name][codecs[layer.name]].seconds_per_byte)
            if layer.name in codecs else layer for layer in self.w.layers))

    def config(self, sched: SchedulerConfig, codecs: Mapping[str, str]) -> IterationConfig:
        layer_codecs = {name: self.models[name][spec] for name, spec in codecs.items()}
        return IterationConfig(scheduler=sched, mode=self.mode, layer_codecs=layer_codecs,
                               host_s_per_message=self.cpu_per_message,
                               host_s_per_byte=self.cpu_per_byte)

    def price(self, sched: SchedulerConfig, codecs: Mapping[str, str], label: str) -> Candidate:
        key = (sched, tuple(sorted(codecs.items())))
        if key not in self.priced:
            seconds = simulate(self.workload(codecs), self.topo,
                               self.config(sched, codecs)).iteration_s
            self.priced[key] = Candidate(label, sched, MappingProxyType(dict(codecs)), seconds)
        return self.priced[key]

    def policy_of(self, candidate: Candidate) -> str:
        """The policy ``candidate`` runs under (an open one decided by its plan, as the
        runtime decides it)."""
        config = self.config(candidate.scheduler, candidate.codecs)
        items = plan_items(self.workload(candidate.codecs).layers, config)
        return plan_and_policy(items, candidate.scheduler)[1].policy

    def descend(self, start: SchedulerConfig, codecs: Mapping[str, str], tag: str,
                passes: int = 2, fixed: tuple[str, ...] = ()) -> Candidate:
        """Coordinate descent over :data:`SEARCH` (but the ``fixed`` fields), from ``start``;
        strict improvements only."""
        best = self.price(start, codecs, f"{tag}{_label(start)}")
        for _ in range(passes):
            moved = False
            for field, values in SEARCH.items():
                if field in fixed:
                    continue
                for value in values:
                    sched = _with(best.scheduler, field, value)
                    if sched is None or sched == best.scheduler:
                        continue
                    cand = self.price(sched, codecs, f"{tag}{_label(sched)}")
                    if cand.predicted_s < best.predicted_s * (1 - 1e-9):
                        best, moved = cand, True
            if not moved:
                break
        return best


def _with(sched: SchedulerConfig, field: str, value: Any) -> SchedulerConfig | None:
    """``sched`` with one searched field changed (credit kept a multiple of the chunk)."""
    if sched.policy == "fifo" and field in ("partition_bytes", "credit", "urgent_bytes"):
        return None  # fields the fifo policy does not use
    multiple = max(sched.credit_bytes // sched.partition_bytes, 1)
    if field == "credit":
        return replace(sched, credit_bytes=sched.partition_bytes * value)
    if field == "partition_bytes":
        return replace(sched, partition_bytes=value, credit_bytes=value * multiple)
    if field == "policy" and value == "fifo":  # the priority-only fields do not matter
        return replace(sched, policy="fifo")
    return replace(sched, **{field: value})


def _label(s: SchedulerConfig) -> str:
    if s.policy == "fifo":
        return (f"fifo bucket={format_bytes(s.bucket_bytes)} "
                f"first={format_bytes(s.first_bucket_bytes)}")
    return (f"priority bucket={format_bytes(s.bucket_bytes)} first={format_bytes(s.first_bucket_bytes)}"
            f" chunk={format_bytes(s.partition_bytes)} credit={format_bytes(s.credit_bytes)} "
            f"urgent={format_bytes(s.urgent_bytes)}")


def _codec_options(workload: Workload, link: LinkModel,
                   models: Mapping[str, Mapping[str, CodecModel]]) -> list[tuple[str, dict[str, str]]]:
    """Codec assignments worth pricing: each spec (and each layer's own best spec) on the
    1, 2, 4, ... largest layers it may compress."""
    sizes = {layer.name: layer.grad_bytes for layer in workload.layers}
    by_size = sorted((n for n in models if sizes.get(n)), key=lambda n: (-sizes[n], n))

    def alone(name: str, spec: str) -> float:  # one layer's exchange on its own
        m = models[name][spec]
        wire = sizes[name] * m.ratio * (1 if m.summable else link.ranks)
        return link.allreduce_s(wire) + sizes[name] * m.seconds_per_byte

    best_own = {}
    for name in by_size:
        spec = min(sorted(models[name]), key=lambda sp: alone(name, sp))
        if alone(name, spec) < link.allreduce_s(sizes[name]):
            best_own[name] = spec
    specs = sorted({spec for name in by_size for spec in models[name]})
    options = []
    for label, pick in [*((spec, {n: spec for n in by_size if spec in models[n]}) for spec in specs),
                        ("each layer's best codec", best_own)]:
        names = [n for n in by_size if n in pick]
        count = 1
        while names:
            subset = names[:count]
            options.append((f"{label} on the {len(subset)} largest", {n: pick[n] for n in subset}))
            if count >= len(names):
                break
            count = min(count * 2, len(names))
    return options


def choose(workload: Workload, link: LinkModel, *, mode: str = "overlap",
           default: SchedulerConfig | None = None,
           codecs: Mapping[str, Mapping[str, CodecModel]] | None = None,
           min_gain_exact: float = 0.01, min_gain_lossy: float = 0.10,
           runner_up_within: float = 0.10, codec_competes: bool = True) -> TuneChoice:
    """The best configuration for ``workload`` on ``link``, as predicted by the simulator.

    Args:
        workload: one rank's layers (forward order), measured compute and gradient bytes.
        link: the measured link.
        mode: ``"overlap"`` (a DistributedOptimizer in overlap mode) or ``"sync"``.
        default: the configuration to beat (default: ``SchedulerConfig()``).
        codecs: layer name -> {codec spec: measured model} of the codecs the user allows for
            that layer (empty or ``None``: exact only).
        min_gain_exact: relative predicted gain a scheduling change needs to replace the defaults.
        min_gain_lossy: relative predicted gain over the best exact configuration a lossy codec
            needs to be chosen.
        runner_up_within: when a lossy configuration is chosen, the best one with other
            codecs on at least half the bytes either compresses that also gains
            ``min_gain_lossy`` is its runner-up if predicted within this fraction of the
            chosen one's time; when exact gradients are chosen, the best configuration
            under the other policy (FIFO or priority, as the choice runs) is, on the same
            terms (0: no runner-up).
        codec_competes: the codecs' work takes cores from the compute (a CPU run): it is
            charged to the layer's backward as well as to its exchange (conservative), or,
            where ``link`` has a CPU per byte, as the iteration model charges the link's
            CPU (the share done while the rank computes).

    Returns:
        The :class:`TuneChoice`.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: a bad mode or gain, or codecs for layers the workload does not have.
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not isinstance(link, LinkModel):
        raise TypeError(f"link must be a LinkModel, got {type(link).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, gain in (("min_gain_exact", min_gain_exact), ("min_gain_lossy", min_gain_lossy),
                       ("runner_up_within", runner_up_within)):
        if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {gain!r}")
    default = default or SchedulerConfig()
    if not isinstance(default, SchedulerConfig):
        raise TypeError(f"default must be a SchedulerConfig, got {type(default).__name__}")
    models = {name: dict(specs) for name, specs in (codecs or {}).items() if specs}
    unknown = sorted(set(models) - {layer.name for layer in workload.layers})
    if unknown:
        raise ValueError(f"codecs for layers the workload does not have: {unknown}")
    if link.ranks == 1 or not workload.grad_bytes:
        return _trivial(workload, link, default)
    search = _Search(workload, link, mode, models, bool(codec_competes))
    base = search.price(default, {}, f"defaults: {_label(default)}")
    exact = search.descend(default, {}, "exact, ")
    reasons = []
    gain = 1 - exact.predicted_s / base.predicted_s
    if gain < min_gain_exact:
        reasons.append(f"no scheduling change is predicted to gain {min_gain_exact:.0%} over "
                       f"the defaults (best: {gain:+.1%}): the defaults stay")
        exact = base
    else:
        reasons.append(f"scheduling: {_label(exact.scheduler)} is predicted {gain:.1%} faster "
                       "than the defaults")
    chosen, runner_up = exact, None
    if models:
        priced = [search.price(exact.scheduler, pick, f"{label}, {_label(exact.scheduler)}")
                  for label, pick in _codec_options(workload, link, models)]
        lossy = _best_descended(search, priced, default, min_gain_exact)
        if lossy is not None:
            gain = 1 - lossy.predicted_s / exact.predicted_s
            if gain >= min_gain_lossy:
                runner_up = _runner_up(search, priced, lossy, runner_up_within,
                                       exact.predicted_s * (1 - min_gain_lossy),
                                       default, min_gain_exact) \
                    if runner_up_within else None
                if runner_up is not None and runner_up.predicted_s < lossy.predicted_s:
                    # tuned for its codecs, the runner-up came out ahead: it is the choice
                    lossy, runner_up = runner_up, lossy
                    gain = 1 - lossy.predicted_s / exact.predicted_s
                    if runner_up.predicted_s > lossy.predicted_s * (1 + runner_up_within):
                        runner_up = None
                chosen = lossy
                moved = "" if lossy.scheduler == exact.scheduler else \
                    f" (with {_label(lossy.scheduler)})"
                reasons.append(f"codecs: {lossy.label.split(',')[0]}{moved} is predicted "
                               f"{gain:.1%} faster than exact gradients (needs {min_gain_lossy:.0%})")
                if runner_up is not None:
                    reasons.append(f"runner-up: {runner_up.label.split(',')[0]} is predicted "
                                   f"within {runner_up_within:.0%} of the choice "
                                   f"({runner_up.predicted_s / lossy.predicted_s - 1:+.1%}): "
                                   "both are timed")
            else:
                reasons.append(f"codecs: the best ({lossy.label.split(',')[0]}) is predicted "
                               f"{gain:+.1%} against exact gradients, below the "
                               f"{min_gain_lossy:.0%} a lossy codec must gain: exact gradients")
    else:
        reasons.append("codecs: none allowed (exact gradients)")
    if not chosen.codecs and runner_up_within:
        runner_up = _other_policy(search, chosen, runner_up_within)
        if runner_up is not None:
            reasons.append(f"runner-up: {_label(runner_up.scheduler)} is predicted within "
                           f"{runner_up_within:.0%} of the choice "
                           f"({runner_up.predicted_s / chosen.predicted_s - 1:+.1%}), and the "
                           "model does not price two lanes at once: both are timed")
    exposed = max(chosen.predicted_s - workload.compute_s, 0.0)
    reasons.append(f"predicted exposed communication {format_time(exposed)}/it; all-reducing "
                   f"every gradient once would take "
                   f"{format_time(link.allreduce_s(workload.grad_bytes))}")
    ranked = sorted(search.priced.values(), key=lambda c: (c.predicted_s, c.label))
    return TuneChoice(scheduler=chosen.scheduler, codecs=chosen.codecs,
                      predicted_s=chosen.predicted_s, default_s=base.predicted_s,
                      exact_s=exact.predicted_s, compute_s=workload.compute_s, link=link,
                      reasons=tuple(reasons), candidates=tuple(ranked), runner_up=runner_up)


def _best_descended(search: _Search, priced: list[Candidate], default: SchedulerConfig,
                    min_gain: float) -> Candidate | None:
    """The best of ``priced`` codec assignments, its scheduler then tuned for it; the default
    scheduling options with those codecs unless the tuned ones are predicted ``min_gain``
    faster, as for exact gradients. With a codec the bytes shrink, and so may what the exact
    plan's options gain, while their cost in CPU, which the model does not see, stays: on the
    transformer at 100 Mbit/s, PowerSGD on the exact plan's 1 MB buckets ran at a median
    0.93x of ``powersgd:2`` on the default 8 MB ones in two runs (benchmarks/RESULTS.md, stop 17)."""
    best = min(priced, key=lambda c: c.predicted_s, default=None)
    if best is None:
        return None
    kind = best.label.split(",")[0]
    tuned = search.descend(best.scheduler, best.codecs, f"{kind}, ", passes=1)
    plain = search.price(default, best.codecs, f"{kind}, {_label(default)}")
    return tuned if tuned.predicted_s <= plain.predicted_s * (1 - min_gain) else plain


def _other_policy(search: _Search, chosen: Candidate, within: float) -> Candidate | None:
    """The best configuration under the policy ``chosen`` does not run (its other options
    tuned from ``chosen``'s), when it is predicted within ``within`` of ``chosen``."""
    other = "fifo" if search.policy_of(chosen) == "priority" else "priority"
    start = replace(chosen.scheduler, policy=other)
    best = search.descend(start, chosen.codecs, "exact, ", passes=1, fixed=("policy",))
    return best if best.predicted_s <= chosen.predicted_s * (1 + within) else None


def _runner_up(search: _Search, priced: list[Candidate], chosen: Candidate, within: float,
               at_most_s: float, default: SchedulerConfig, min_gain: float) -> Candidate | None:
    """The best assignment that differs from ``chosen``'s on at least half the gradient bytes
    either compresses (another codec, not the same one on a layer more or less), tuned, when
    it is predicted within ``within`` of ``chosen`` and no slower than ``at_most_s``."""
    sizes = {layer.name: layer.grad_bytes for layer in search.w.layers}

    def differs(codecs: Mapping[str, str]) -> bool:
        names = set(codecs) | set(chosen.codecs)
        other = sum(sizes[n] for n in names if codecs.get(n) != chosen.codecs.get(n))
        return 2 * other >= sum(sizes[n] for n in names)

    runner = _best_descended(search, [c for c in priced if differs(c.codecs)], default, min_gain)
    if runner is None or runner.predicted_s > min(chosen.predicted_s * (1 + within), at_most_s):
        return None
    return runner


def _trivial(workload: Workload, link: LinkModel, default: SchedulerConfig) -> TuneChoice:
    """One rank or nothing to exchange: nothing to tune."""
    why = "one rank: nothing to exchange" if link.ranks == 1 else "no gradients to exchange"
    seconds = workload.compute_s
    return TuneChoice(scheduler=default, codecs=MappingProxyType({}), predicted_s=seconds,
                      default_s=seconds, exact_s=seconds, compute_s=seconds, link=link,
                      reasons=(f"{why}: the defaults stay",),
                      candidates=(Candidate("defaults", default, MappingProxyType({}), seconds),))

