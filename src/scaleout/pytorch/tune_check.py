"""The autotuner's last word is a measurement: a choice that runs slower than the defaults
did is undone, and a runner-up the model could not tell from the choice is timed too.

The tuner chooses with a model (:func:`scaleout.sim.tuning.choose`); a model can be wrong
where it does not see a cost (DLRM's compressed tables at 1 Gbit/s were predicted at 31-49 ms
per iteration and ran at 64-79 ms; benchmarks/RESULTS.md, "The autotuner"). So after the
rebuild, :class:`ChoiceCheck` times the chosen plan by the wall clock between forwards, each
window after one iteration to settle. When the choice has a runner-up (another codec, or the
other policy, predicted within a few percent) the two are timed in the order choice,
runner-up, choice: the choice's ``verify`` iterations are split into two windows around the
runner-up's ``verify``, so a warm-up whose iterations are still getting faster (or slower)
favours neither. Timed one after the other, the runner-up went second and drew the drift:
ResNet-18 at 100 Mbit/s kept top-k, timed 3.6% faster than PowerSGD during a warm-up whose
compute ran at 1.22 s/it, and ran 6% slower than PowerSGD afterwards at 0.90 s/it (RESULTS.md,
stop 41). The runner-up is kept only when it beats the choice by more than the choice's own
two windows differ (the check's noise and drift; within it, the model's choice stands). The
one kept is compared with the defaults' time per iteration over the measured iterations
before tuning. Every figure is the slowest rank's (an all-reduce MAX), so every
rank decides alike; the plan is rebuilt with what won (the defaults when every trial was
slower than they were).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from scaleout.core.collectives import ReduceOp, allreduce
from scaleout.sim.units import format_time

__all__ = ["ChoiceCheck", "check_iterations", "slowest", "windows"]


def slowest(comm: Any, device: torch.device, values: list[float]) -> list[float]:
    """Each of ``values`` as the slowest (largest) rank's figure, the same list on every rank
    of ``comm`` (an all-reduce MAX), so that every rank decides alike."""
    figures = torch.tensor(values, dtype=torch.float64, device=device)
    if comm.size > 1:
        allreduce(comm, figures, ReduceOp.MAX).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return figures.tolist()


def windows(verify: int, trials: int) -> tuple[tuple[int, int], ...]:
    """The check's timed windows as ``(trial, iterations)``, in the order they run: the choice
    alone, or the choice, the runner-up and the choice again, each choice window
    ``ceil(verify / 2)`` iterations (the two centred on the runner-up's)."""
    if trials == 1:
        return ((0, verify),)
    half = -(-verify // 2)
    return ((0, half), (1, verify), (0, half))


def check_iterations(verify: int, trials: int) -> int:
    """Forwards the check takes, each window's settling iteration included."""
    return sum(1 + n for _, n in windows(verify, trials))


@dataclass
class ChoiceCheck:
    """One pending check of a tuning choice (see the module docstring).

    Attributes:
        default_s: the defaults' measured seconds per iteration (this rank's).
        fallback: the ``(scheduler, compression)`` the choice replaced.
        verify: iterations of each trial to time (the choice's split in two windows when it
            has a runner-up: :func:`windows`).
        plans: the trials' ``(scheduler, compression)``: the choice's (in use when the check
            starts), then its runner-up's when it has one.
        mark: the model's exchanged backwards (``model._exchanges``) at the forward that
            built the plan being timed (the choice's, at first).
    """

    default_s: float
    fallback: tuple[Any, Any]
    verify: int
    plans: tuple[tuple[Any, Any], ...]
    mark: int = 0
    _since: int | None = None  # ... when its timing began (after its settling iteration)
    _started: float = 0.0
    _seconds: list[float] = field(default_factory=list)  # per iteration, per window so far

    def at_forward(self, model: Any, choice: Any) -> Any | None:
        """Call at the start of every forward after the rebuild; returns the choice as it
        stands once decided (what was kept named in its reasons), else ``None``.

        The windows count the model's exchanged backwards (``model._exchanges``, alike on
        every rank), not forwards: a forward of this rank's own that no backward follows
        (autograd on) moves no window, so every rank rebuilds at the same iteration. Until
        stop 51 they counted forwards, and such a forward on one rank made that rank rebuild
        early: the ranks hung in the rebuild's collectives until the timeout."""
        now, done = time.perf_counter(), model._exchanges
        order = windows(self.verify, len(self.plans))
        trial, iterations = order[len(self._seconds)]
        if done <= self.mark:  # (the window's settling iteration is not over)
            return None
        if self._since is None:  # it is over: time from here
            self._started, self._since = now, done
            return None
        if done - self._since < iterations:
            return None
        self._seconds.append((now - self._started) / (done - self._since))
        if len(self._seconds) < len(order):  # the next window's turn
            model.synchronize()
            model._rebuild(*self.plans[order[len(self._seconds)][0]])
            self.mark, self._since = done, None
            return None
        default_s, *seconds = slowest(model.comm, model._device, [self.default_s, *self._seconds])
        best, times, said = _verdict(seconds)
        said = f"measured per iteration: {said}; the defaults {format_time(default_s)}"
        if times[best] > default_s:
            model.synchronize()
            model._rebuild(*self.fallback)
            return replace(choice, scheduler=self.fallback[0], codecs={}, runner_up=None,
                           reasons=(*choice.reasons, said + ": the defaults are restored"))
        if best != trial:  # (``trial``: the one in use)
            model.synchronize()
            model._rebuild(*self.plans[best])
        if best == 0:
            return replace(choice, reasons=(*choice.reasons, said + ": the choice is kept"))
        runner = choice.runner_up
        return replace(choice, scheduler=runner.scheduler, codecs=runner.codecs,
                       predicted_s=runner.predicted_s, runner_up=None,
                       reasons=(*choice.reasons, said + ": the runner-up is kept"))


def _verdict(seconds: list[float]) -> tuple[int, list[float], str]:
    """From the windows' seconds per iteration (the slowest rank's, in :func:`windows`' order):
    the trial that won, each trial's seconds per iteration, and what was measured in words.

    The runner-up wins only by more than the choice's own two windows differ: that difference
    is the check's noise and drift, and within it the model's choice stands. (ResNet-18 at 100
    Mbit/s, stop 42: in ten runs the two trials read 0.5-15% apart, either way, and the runs
    that kept either plan ran at the same 1.18-1.35 s/it afterwards.)"""
    if len(seconds) == 1:
        return 0, seconds, f"the choice {format_time(seconds[0])}"
    first, runner_s, second = seconds
    choice_s = (first + second) / 2
    spread = abs(first - second)
    said = (f"the choice {format_time(choice_s)} (windows {format_time(first)} and "
            f"{format_time(second)}), the runner-up {format_time(runner_s)}")
    if runner_s < choice_s - spread:
        return 1, [choice_s, runner_s], said
    if runner_s < choice_s:
        said += (f" (its {100 * (1 - runner_s / choice_s):.1f}% lead is within the choice's "
                 f"own spread, {100 * spread / choice_s:.1f}%)")
    return 0, [choice_s, runner_s], said
