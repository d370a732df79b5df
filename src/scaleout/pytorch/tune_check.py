"""The autotuner's last word is a measurement: a choice that runs slower than the defaults
did is undone.

The tuner chooses with a model (:func:`scaleout.sim.tuning.choose`); a model can be wrong
where it does not see a cost (DLRM's compressed tables at 1 Gbit/s were predicted at 31-49 ms
per iteration and ran at 64-79 ms; benchmarks/RESULTS.md, "The autotuner"). So after the
rebuild, :class:`ChoiceCheck` lets one iteration settle, times ``verify`` iterations of the
chosen plan by the wall clock between forwards, and compares them with the defaults' time
per iteration over the measured iterations before tuning. Both figures are the slowest
rank's (an all-reduce MAX), so every rank decides alike; when the choice was slower, the
plan is rebuilt with the options it replaced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
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
        verify: iterations of the choice to time.
    """

    default_s: float
    fallback: tuple[Any, Any]
    verify: int
    _forwards: int = 0
    _started: float = 0.0

    def at_forward(self, model: Any, choice: Any) -> Any | None:
        """Call at the start of every forward after the rebuild; returns the choice as it
        stands once decided (restored defaults named in its reasons), else ``None``."""
        now = time.perf_counter()
        self._forwards += 1
        if self._forwards == 1:  # the chosen plan's first iteration is over: time from here
            self._started = now
            return None
        if self._forwards <= self.verify:
            return None
        default_s, chosen_s = slowest(model.comm, model._device,
                                      [self.default_s, (now - self._started) / self.verify])
        said = (f"measured: the choice ran {format_time(chosen_s)} per iteration, the defaults "
                f"{format_time(default_s)}")
        if chosen_s <= default_s:
            return replace(choice, reasons=(*choice.reasons, said + ": kept"))
        model.synchronize()
        model._rebuild(*self.fallback)
        return replace(choice, scheduler=self.fallback[0], codecs={},
                       reasons=(*choice.reasons, said + ": the defaults are restored"))
