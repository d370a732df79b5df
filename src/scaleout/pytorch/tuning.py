"""The autotuner of :class:`~scaleout.pytorch.DataParallel`: measure, agree, choose, rebuild,
check.

With ``DataParallel(..., tune=True)`` the first iterations run with the default scheduling
options while they are measured: each layer's forward and backward compute (the model's
:class:`~scaleout.session.Statistics`), then, at the start of a later forward, the link (a few
all-reduces of two sizes on the data group: latency and bytes per second) and, when lossy
codecs are allowed, what each candidate codec costs and saves on each layer (encode + decode
of tensors of that layer's shapes). Every rank's measurements are combined with an
all-reduce (the slowest rank's figure counts), so every rank feeds the same numbers to the
same deterministic search (:func:`scaleout.sim.tuning.choose`, the simulator pricing the
runtime's own plans) and makes the same choice, which is verified across ranks before the
plan is rebuilt with it. The choice is then timed for ``TuneConfig.verify`` iterations (and so
is its runner-up, an alternative the model predicts within ``TuneConfig.runner_up_within`` of
it: another codec, or for exact gradients the other policy, timed between two halves of the
choice's); the runner-up is kept only when clearly faster, and the defaults come back when
they ran faster than what was kept (:mod:`scaleout.pytorch.tune_check`).

Example (every rank):
    >>> model = DataParallel(net, dist, tune=TuneConfig(allow_lossy=True))
    >>> opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model)
    >>> for step in range(100): ...                    # tunes itself at iteration 4
    >>> print(model.tuning.summary())                  # what it chose and why
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from scaleout.compression import CompressionConfig, make_codec
from scaleout.compression.advice import optimizer_traits
from scaleout.core.consistency import verify_plan
from scaleout.pytorch.tune_check import ChoiceCheck, slowest
from scaleout.pytorch.tune_measure import codec_models, link_model, measure_codec, measure_link
from scaleout.scheduler import SchedulerConfig
from scaleout.session.bucket import scheduler_as_run
from scaleout.session.statistics import OperationStats
from scaleout.sim.tuning import LinkModel, TuneChoice, choose
from scaleout.sim.workload import Layer, Workload

__all__ = ["TuneConfig", "Tuner", "as_tune_config", "tuner_for", "LOSSY_CODECS"]

log = logging.getLogger("scaleout.tune")

#: Codecs a lossy tuning may choose from (each also filtered by ``Codec.unsuited``).
LOSSY_CODECS = ("cast:bf16", "blockquant", "powersgd:rank=2", "topk:ratio=0.01")


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """How :class:`~scaleout.pytorch.DataParallel` tunes itself.

    Attributes:
        allow_lossy: may choose lossy codecs (per layer); ``False``: exact gradients only.
            Never with every rank on one machine (a rendezvous on 127.x, ``localhost`` or
            ``::1``, or a launcher that puts every rank on this node: the launch's
            ``one_machine``) unless ``link`` is given.
        codecs: the codec specs a lossy tuning may choose from.
        skip: iterations left unmeasured first, >= 1 (the first builds the plan).
        measure: iterations whose compute is measured; tuning happens at the start of the
            forward after them (iteration ``skip + measure + 1``).
        min_gain_lossy: a codec must be predicted this much faster than exact gradients.
        min_gain_exact: a scheduling change must be predicted this much faster than the
            defaults.
        optimizer: the torch optimizer, for ``Codec.unsuited`` advice when no
            DistributedOptimizer is attached (lossy tuning without either stays exact).
        link: a :class:`~scaleout.sim.tuning.LinkModel` to tune for instead of measuring the
            link (what-if tuning; tests). Its ranks must be the data group's size.
        verify: iterations of the chosen plan timed (after one to settle) before it is kept:
            when they ran slower than the defaults did, the defaults come back
            (:mod:`scaleout.pytorch.tune_check`); 0 keeps the choice unmeasured.
        runner_up_within: the choice's best alternative (another codec; for exact gradients
            the other policy) predicted within this fraction of it is timed too, between two
            windows of the choice (``verify`` iterations each, after one to settle; the
            choice's split in two), and kept when it leads by more than the choice's two
            windows differ; 0 (or ``verify=0``): none.

    Raises:
        ValueError / TypeError: a bad value (an unknown codec spec included).
    """

    allow_lossy: bool = False
    codecs: tuple[str, ...] = LOSSY_CODECS
    skip: int = 1
    measure: int = 2
    min_gain_lossy: float = 0.10
    min_gain_exact: float = 0.01
    optimizer: torch.optim.Optimizer | None = None
    link: LinkModel | None = None
    verify: int = 2
    runner_up_within: float = 0.10

    def __post_init__(self) -> None:
        if not isinstance(self.allow_lossy, bool):
            raise TypeError(f"allow_lossy must be a bool, got {self.allow_lossy!r}")
        codecs = self.codecs  # (a generator was used up by the check: a tuple first)
        if not isinstance(codecs, str) and isinstance(codecs, Iterable):
            codecs = tuple(codecs)
        if not isinstance(codecs, tuple) or not all(isinstance(c, str) for c in codecs):
            raise TypeError(f"codecs must be a tuple of codec specs, got {self.codecs!r}")
        object.__setattr__(self, "codecs", codecs)
        for spec in self.codecs:
            if make_codec(spec).name == "none":
                raise ValueError("codecs lists lossy codecs; 'none' is always a candidate")
        # skip >= 1: the first forward builds the plan and is never measured (0 was taken and
        # tuned as 1)
        for name, low in (("skip", 1), ("measure", 1), ("verify", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        for name in ("min_gain_lossy", "min_gain_exact", "runner_up_within"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise TypeError(f"link must be a LinkModel or None, got {type(self.link).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch optimizer, got {type(self.optimizer).__name__}")

    @property
    def after(self) -> int:
        """Iterations run before the tuning."""
        return self.skip + self.measure


def as_tune_config(tune: Any) -> TuneConfig | None:
    """``DataParallel``'s ``tune=`` as a :class:`TuneConfig`: ``False``/``None`` off, ``True``
    exact only, ``"lossy"`` lossy codecs allowed, a TuneConfig as it is.

    Raises:
        ValueError / TypeError: anything else.
    """
    if tune is None or tune is False:
        return None
    if tune is True:
        return TuneConfig()
    if isinstance(tune, TuneConfig):
        return tune
    if isinstance(tune, str):
        if tune in ("lossy", "exact"):
            return TuneConfig(allow_lossy=tune == "lossy")
        raise ValueError(f"tune must be True, False, 'exact', 'lossy' or a TuneConfig, got {tune!r}")
    raise TypeError(f"tune must be a bool, 'exact', 'lossy' or a TuneConfig, got "
                    f"{type(tune).__name__}")


def tuner_for(tune: Any, *, compression: Any, distributed_update: bool,
              ranks: int | None = None) -> Tuner | None:
    """DataParallel's :class:`Tuner` for ``tune=`` (``None``: no tuning).

    Raises:
        ValueError: ``tune`` with ``compression=`` (the tuner chooses codecs itself) or with
            ``distributed_update=True`` (not tuned yet); a ``link`` for other than ``ranks``
            (the data group's size); a bad ``tune``, as :func:`as_tune_config` raises.
        TypeError: as :func:`as_tune_config` raises.
    """
    config = as_tune_config(tune)
    if config is None:
        return None
    if compression is not None or distributed_update:
        raise ValueError("tune= chooses the codecs itself and plans fusible buckets: pass it "
                         "without compression= and without distributed_update=True")
    if config.link is not None and ranks is not None and config.link.ranks != ranks:
        raise ValueError(f"TuneConfig.link is for {config.link.ranks} ranks; the data group "
                         f"has {ranks}")  # (said at the 4th forward before)
    return Tuner(config)


class Tuner:
    """One DataParallel model's tuning: when it happens, what it measured, what it chose.

    Args:
        config: the :class:`TuneConfig`.

    Attributes:
        choice: the :class:`~scaleout.sim.tuning.TuneChoice` once tuned, else ``None``.
    """

    def __init__(self, config: TuneConfig) -> None:
        self.config = config
        self.choice: TuneChoice | None = None
        self._start: dict[str, tuple[float, float]] | None = None
        # The clock that says when to tune is the model's count of exchanged backwards (equal
        # on every rank), read at each forward whose backward exchanges (DataParallel calls
        # before_forward only at those: a rank's evaluation forwards and no_sync() micro-
        # batches are its own); a rank's statistics can be reset on that rank alone.
        self._iterations = 0  # iterations completed at the last forward
        self._start_iteration = 0
        self._start_seen = 0  # this rank's statistics.iterations at the snapshot
        self._last_seen = 0
        self._reset = False  # this rank's statistics were reset after the snapshot
        self._started = 0.0  # wall clock at the first measured iteration's forward
        self._check: ChoiceCheck | None = None
        self._default: SchedulerConfig | None = None  # the user's, as the session runs it

    @property
    def done(self) -> bool:
        return self.choice is not None

    def before_forward(self, model: Any, now: bool = False) -> None:
        """At the start of every forward of ``model`` (every rank): measure; at the tuning
        iteration (or ``now``, once an iteration was measured) settle, tune and rebuild the
        model's plan with the choice (when it differs from the plan in use).

        Raises:
            RuntimeError: ``now`` before one iteration was measured.
        """
        if not now:  # the clock: backwards that exchanged so far, alike on every rank (a
            # rank's own count of forwards ran ahead where its plan was built in no_sync())
            self._iterations = model._exchanges
        if self._check is not None and not now:  # a choice being timed (forwards only)
            decided = self._check.at_forward(model, self.choice)
            if decided is not None:
                self.choice, self._check = decided, None
            return
        completed = self._iterations + (1 if now else 0)  # (now: this forward's is done too)
        if now and not self.done and (model.session is None or self._start is None
                                      or completed <= self._start_iteration):
            raise RuntimeError(f"tuning needs one measured iteration: {self.config.skip + 1} "
                               "iterations first")
        if self.due(model.statistics, model._forward_order) or (now and not self.done):
            iterations = max(completed - self._start_iteration, 1)
            default_s = (time.perf_counter() - self._started) / iterations
            model.synchronize()
            choice = self.tune(model)
            plans = tuple((c.scheduler, compression_for(model, c.codecs))
                          for c in (choice, choice.runner_up) if c is not None)
            scheduler, compression = plans[0]
            changed = compression is not None or scheduler not in (model._scheduler,
                                                                   self._default)
            if changed or choice.runner_up is not None:  # (unchanged: the first trial is in use)
                fallback = (model._scheduler, model._compression)
                if changed:
                    model._rebuild(scheduler, compression)
                if self.config.verify:
                    self._check = ChoiceCheck(default_s=default_s, fallback=fallback,
                                              verify=self.config.verify, plans=plans,
                                              mark=model._exchanges)

    def due(self, statistics: Any, layers: Sequence[Any]) -> bool:
        """Called at the start of every forward: snapshot the compute figures after
        ``skip`` iterations; ``True`` once ``measure`` more have run (time to tune)."""
        if self.done:
            return False
        if self._start is not None and statistics.iterations < self._last_seen:
            self._reset = True  # on this rank: tune() takes its figures since the reset
        self._last_seen = statistics.iterations
        if self._iterations >= self.config.skip and self._start is None:
            self._start, self._start_iteration = _compute(statistics, layers), self._iterations
            self._start_seen = statistics.iterations
            self._started = time.perf_counter()
        return (self._start is not None
                and self._iterations - self._start_iteration >= self.config.measure)

    def tune(self, model: Any) -> TuneChoice:
        """Measure the link (and codecs), agree with the other ranks, choose (every rank)."""
        config, comm, layers = self.config, model.comm, model._forward_order
        assert self._start is not None
        end = _compute(model.statistics, layers)
        seen = model.statistics.iterations
        start, iterations = ((dict.fromkeys(end, (0.0,) * 4), seen) if self._reset
                             else (self._start, seen - self._start_seen))
        iterations = max(iterations, 1)  # per iteration on each rank, then the slowest rank's
        compute = [x / iterations for l in layers for x in (end[l.name][0] - start[l.name][0],
                                                            end[l.name][1] - start[l.name][1])]
        moved = [_moved(end[l.name], start[l.name]) for l in layers]
        specs, reason = self._allowed_codecs(model)
        min_numel = CompressionConfig().min_numel
        codecs = [measure_codec(spec, layer.params, min_numel) for layer in layers for spec in specs]
        link = (measure_link(comm, model._device) if comm.size > 1 and config.link is None
                else [0.0] * 4)
        # the slowest rank's figures: every rank then decides alike
        values = slowest(comm, model._device,
                         [*link, *compute, *moved, *(s for _, s in codecs)])
        fitted = config.link or link_model(comm.size, values[:4], model._device)
        if fitted.ranks != comm.size:
            raise ValueError(f"TuneConfig.link is for {fitted.ranks} ranks; the data group "
                             f"has {comm.size}")
        n = len(layers)
        shares = values[4 + 2 * n:4 + 3 * n]
        workload = _workload(layers, values[4:4 + 2 * n], 1, shares)
        seconds = values[4 + 3 * n:]
        models = codec_models(workload, specs, [(nbytes, s) for (nbytes, _), s
                                                in zip(codecs, seconds)])
        # the defaults as the session runs them: an open policy fifo on one machine, ...
        self._default = scheduler_as_run(model._scheduler, comm, model._device,
                                         model.env.launch.one_machine)
        choice = choose(workload, fitted, mode=model.updates.mode, default=self._default,
                        codecs=models, min_gain_exact=config.min_gain_exact,
                        min_gain_lossy=config.min_gain_lossy,
                        runner_up_within=config.runner_up_within if config.verify else 0.0,
                        codec_competes=model._device.type == "cpu")
        for line in (_sparse_reason(layers, workload, shares), reason):
            if line:
                choice = _with_reason(choice, line)
        if comm.size > 1:
            verify_plan(comm, "tuning choice", choice.key())
        self.choice = choice
        if model.env.rank == 0:
            log.info("scaleout tune (iteration %d):\n%s", config.after + 1, choice.summary())
        return choice

    def _allowed_codecs(self, model: Any) -> tuple[list[str], str]:
        """The codec specs this tuning may choose, and why some (or all) were left out."""
        if not self.config.allow_lossy:
            return [], ""
        launch = model.env.launch
        if self.config.link is None and launch.one_machine:
            # Measured here, a busy machine's loopback can look slow enough for a codec to
            # seem to pay (powersgd, predicted 10.4% faster beside another test run); it
            # cannot: the bytes are memory copies on the cores the codec would use.
            local = f", {launch.local_world_size} ranks local" if launch.local_world_size else ""
            return [], (f"lossy codecs allowed, but every rank is on this machine (rendezvous "
                        f"on {launch.master_addr}{local}): gradients go exact over loopback")
        updater = model.updates.updater
        optimizer = self.config.optimizer or getattr(updater, "_user_optimizer", None)
        if optimizer is None:
            return [], ("lossy codecs allowed, but no optimizer is known to check them "
                        "against: pass TuneConfig(optimizer=...) or use a DistributedOptimizer")
        traits = optimizer_traits(optimizer)
        allowed, refused = [], []
        for spec in self.config.codecs:
            codec = make_codec(spec)
            why = next((r for t in traits if (r := codec.unsuited(t))), None)
            (refused if why else allowed).append(spec)
        reason = (f"left out as unsuited to {type(optimizer).__name__}: {', '.join(refused)}"
                  if refused else "")
        return allowed, reason


def compression_for(model: Any, codecs: Mapping[str, str]) -> CompressionConfig | None:
    """Layer name -> codec spec as a per-parameter CompressionConfig of ``model``'s
    parameters (``None``: exact)."""
    if not codecs:
        return None
    names = {id(p): n for n, p in model.module.named_parameters()}
    layers = {layer.name: layer for layer in model._forward_order}
    return CompressionConfig(codec="none", layers={
        names[id(p)]: spec for layer_name, spec in sorted(codecs.items())
        for p in layers[layer_name].params})


def _compute(statistics: Any, layers: Sequence[Any]) -> dict[str, tuple[float, ...]]:
    """Each layer's accumulated (compute, backward) seconds and (sent, raw) gradient bytes
    (zeros for a layer that has not reported yet: ``operation()`` refuses an unknown name)."""
    return {l.name: (op.compute_s, op.backward_s, float(op.bytes), float(op.raw_bytes))
            for l in layers for op in (statistics.operation(l.name) if l.name in statistics
                                       else OperationStats(),)}


def _moved(end: Sequence[float], start: Sequence[float]) -> float:
    """The share of a layer's gradient bytes that its exchanges moved between two
    :func:`_compute` snapshots (1.0 when none was recorded). The plan being measured is
    exact (``tune=`` refuses ``compression=``), so a share below one is an embedding table
    sent row-sparse (``scaleout.pytorch.lookup_reads``): the rows some rank looked up, and a
    flag per row."""
    raw = end[3] - start[3]
    return max(end[2] - start[2], 0.0) / raw if raw > 0 else 1.0


def _workload(layers: Sequence[Any], compute: Sequence[float], iterations: int,
              shares: Sequence[float] | None = None) -> Workload:
    """The measured workload: per layer, ``compute`` holds (compute, backward) seconds summed
    over ``iterations``, and ``shares`` (default: all 1.0) the share of its gradient bytes
    its exact exchange moves: a row-sparse table is priced at the bytes it sends, so the
    codecs compete with those, not with the dense table (whose payload no codec is measured
    against then: ``codec_models`` leaves out a codec that does not shrink the layer)."""
    if not layers:
        raise RuntimeError("tuning needs at least one layer with parameters")
    shares = [1.0] * len(layers) if shares is None else shares
    return Workload(name="measured", layers=tuple(
        Layer(name=layer.name, forward_s=max(total - backward, 0.0) / iterations,
              backward_s=max(backward, 0.0) / iterations,
              grad_bytes=round(share * sum(p.numel() * p.element_size() for p in layer.params)))
        for layer, total, backward, share in zip(layers, compute[::2], compute[1::2], shares)))


def _sparse_reason(layers: Sequence[Any], workload: Workload, shares: Sequence[float]) -> str:
    """The report's line on the layers priced below their dense bytes, or ``""``."""
    sparse = [(layer.name, share) for layer, share in zip(workload.layers, shares) if share < 0.99]
    if not sparse:
        return ""
    dense = sum(p.numel() * p.element_size() for layer in layers for p in layer.params)
    listed = ", ".join(f"{name} {share:.1%}" for name, share in sparse[:4])
    more = f" and {len(sparse) - 4} more" if len(sparse) > 4 else ""
    return (f"exact gradients row-sparse: {len(sparse)} layer(s) moved a share of their dense "
            f"bytes ({listed}{more}), priced so: {workload.grad_bytes / max(dense, 1):.1%} "
            f"of the {dense / 2**20:.2f} MiB of gradients per iteration")


def _with_reason(choice: TuneChoice, reason: str) -> TuneChoice:
    return replace(choice, reasons=(*choice.reasons, reason))
