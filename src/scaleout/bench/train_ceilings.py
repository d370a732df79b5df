"""Ceiling set-ups for ``scaleout bench train``: what any synchronous data-parallel run could reach.

Neither is a trainer (every rank trains its own copy of the model; the copies drift apart),
both run exactly the workload's compute and optimizer, and both measure a machine and a
network rather than a library:

* ``lockstep`` — the ranks meet once per iteration in a one-element allreduce and move no
  gradients. Synchronous data parallelism computes at least this and meets at least this
  often, so its throughput bounds every such scheme here: what is lost is the ranks
  sharing cores and memory, and the slower rank setting each iteration's pace.
* ``lockstep-traffic`` — ``lockstep`` plus, on a process group of its own, one allreduce of
  as many floats as the model has parameters, started at each step and waited for at the
  next: a whole iteration to hide the exact gradients' bytes, in one collective, with no
  framework code. Against ``lockstep`` it was meant to show what moving those bytes costs the
  compute (gloo's threads and the kernel's network path take the same cores), but it costs
  more than that: on ResNet-18 at 1 Gbit/s ~400 ms per iteration for 44.7 MB, where the
  transfer's own CPU is ~40 ms (``benchmarks/host_cpu_probe.py``), and scaleout's exact
  training beat it by 7.7% and 11.7% (benchmarks/RESULTS.md, stop 25; why is not known). Read
  it as a reference point, not a bound.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from scaleout.core.gloo_device import new_group_on_world_device

__all__ = ["CEILINGS", "LockstepSGD", "build_lockstep"]

#: Ceiling configurations a user may name with ``--vs``.
CEILINGS = ("lockstep", "lockstep-traffic")


class LockstepSGD(torch.optim.SGD):
    """SGD whose ``step()`` first meets the other ranks (a one-element allreduce).

    Args:
        params: the parameters or parameter groups, as for :class:`torch.optim.SGD`.
        traffic: also keep one allreduce of ``sum(p.numel())`` floats in flight on its own
            process group, waited for one step after it started.
        **options: SGD's options (``lr``, ``momentum``, ...).
    """

    def __init__(self, params: Any, *, traffic: bool = False, **options: Any) -> None:
        super().__init__(params, **options)
        numel = sum(p.numel() for group in self.param_groups for p in group["params"])
        self._token = torch.zeros(1)
        self._bytes = torch.zeros(numel) if traffic else None
        # (on the world group's gloo device, as scaleout's groups: no idle I/O thread more)
        self._group = new_group_on_world_device(backend="gloo") if traffic else None
        self._inflight: Any = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        tdist.all_reduce(self._token)
        if self._bytes is not None:
            if self._inflight is not None:
                self._inflight.wait()
            self._inflight = tdist.all_reduce(self._bytes, group=self._group, async_op=True)
        return super().step(closure)

    def finish(self) -> None:
        """Wait for the traffic still in flight (before the timed loop ends, and at exit)."""
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None


def build_lockstep(params: Any, *, traffic: bool, timeout_s: float,
                   **sgd: Any) -> LockstepSGD:
    """Join the job (gloo, ``env://``) and return a lockstep optimizer of ``params``
    (parameters or parameter groups)."""
    tdist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    return LockstepSGD(params, traffic=traffic, **sgd)
