"""The autotuner's last word is a measurement: a choice that runs slower than the defaults
did is undone, and a runner-up the model could not tell from the choice is timed too.

The tuner chooses with a model (:func:`scaleout.sim.tuning.choose`); a model can be wrong
where it does not see a cost (DLRM's compressed tables at 1 Gbit/s were predicted at 31-49 ms
per iteration and ran at 64-79 ms; benchmarks/RESULTS.md, "The autotuner"). So after the
rebuild, :class:`ChoiceCheck` lets one iteration settle, times ``verify`` iterations of the
chosen plan by the wall clock between forwards and, when the choice has a runner-up (another
codec predicted within a few percent), rebuilds with the runner-up and times it the same way.
The fastest of them is compared with the defaults' time per iteration over the measured
iterations before tuning. Every figure is the slowest rank's (an all-reduce MAX), so every
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

__all__ = ["ChoiceCheck", "slowest"]


def slowest(comm: Any, device: torch.device, values: list[float]) -> list[float]:
    """Each of ``values`` as the slowest (largest) rank's figure, the same list on every rank
    of ``comm`` (an all-reduce MAX), so that every rank decides alike."""
    figures = torch.tensor(values, dtype=torch.float64, device=device)
    if comm.size > 1:
        allreduce(comm, figures, ReduceOp.MAX).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return figures.tolist()


@dataclass
class ChoiceCheck:
    """One pending check of a tuning choice (see the module docstring).

    Attributes:
        default_s: the defaults' measured seconds per iteration (this rank's).
        fallback: the ``(scheduler, compression)`` the choice replaced.
        verify: iterations of each trial to time.
        plans: the trials' ``(scheduler, compression)``: the choice's (in use when the check
            starts), then its runner-up's when it has one.
    """

    default_s: float
    fallback: tuple[Any, Any]
    verify: int
    plans: tuple[tuple[Any, Any], ...]
    _forwards: int = 0
    _started: float = 0.0
    _times: list[float] = field(default_factory=list)

    def at_forward(self, model: Any, choice: Any) -> Any | None:
        """Call at the start of every forward after the rebuild; returns the choice as it
        stands once decided (what was kept named in its reasons), else ``None``."""
        now = time.perf_counter()
        self._forwards += 1
        if self._forwards == 1:  # the plan's first iteration is over: time from here
            self._started = now
            return None
        if self._forwards <= self.verify:
            return None
        self._times.append((now - self._started) / self.verify)
        if len(self._times) < len(self.plans):  # the next trial's turn
            model.synchronize()
            model._rebuild(*self.plans[len(self._times)])
            self._forwards = 0
            return None
        default_s, *times = slowest(model.comm, model._device, [self.default_s, *self._times])
        said = ", ".join(f"{name} {format_time(t)}" for name, t in
                         zip(("the choice", "the runner-up"), times))
        said = f"measured per iteration: {said}; the defaults {format_time(default_s)}"
        best = min(range(len(times)), key=lambda i: (times[i], i))
        if times[best] > default_s:
            model.synchronize()
            model._rebuild(*self.fallback)
            return replace(choice, scheduler=self.fallback[0], codecs={}, runner_up=None,
                           reasons=(*choice.reasons, said + ": the defaults are restored"))
        if best != len(times) - 1:  # another trial is in use
            model.synchronize()
            model._rebuild(*self.plans[best])
        if best == 0:
            return replace(choice, reasons=(*choice.reasons, said + ": the choice is kept"))
        runner = choice.runner_up
        return replace(choice, scheduler=runner.scheduler, codecs=runner.codecs,
                       predicted_s=runner.predicted_s, runner_up=None,
                       reasons=(*choice.reasons, said + ": the runner-up is kept"))
