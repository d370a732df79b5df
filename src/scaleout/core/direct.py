"""Small allreduces over gloo as one exchange: every rank sends its whole tensor to every
other rank and reduces what it receives, in rank order.

Gloo's ring allreduce pays a fixed cost per call that dwarfs a small tensor's transfer: it
cuts the tensor into segments and runs a reduce-scatter and an all-gather over them, each
step a message and a wake-up of gloo's threads (strace: 12 ``writev`` and ~26 ``futex`` per
allreduce of 64 KB at 2 ranks). One ``all_to_all_single`` of ``p`` copies of the tensor is
one message to each peer. Measured (``benchmarks/allreduce_probe.py``, benchmarks/RESULTS.md,
"Small allreduces in one exchange", stop 28), gloo's time / this one's at 16, 64 and 128 KB:

* loopback: 2 ranks 3.0x, 2.8x, 2.1x; 3 ranks 2.7x, 2.3x, 2.2x;
* the 1 Gbit/s testbed: 2 ranks 3.3x, 2.5x, 0.93x; 3 ranks 2.9x, 2.7x, 1.6x.

Above that it stops paying: a first version that went to 512 KB read 0.4-0.9x at 256-512 KB
on loopback, and 0.82x at 240 KB on the testbed (gloo's all-to-all sends before it receives,
so a pair's two directions run one after the other, where the ring's run at once).

So it is taken for tensors of at most :data:`MAX_BYTES` that put at most
:data:`MAX_SENT_BYTES` on the wire out of each rank (``(p - 1)`` copies, where the ring sends
``2 (p - 1) / p`` of one: the same bytes at 2 ranks, more from 3). Every rank reduces the same
``p`` tensors in the same order (rank 0's first), so the results are equal bit for bit on
every rank, as gloo's are; they may differ from gloo's in the last bits (another summation
order).

``SCALEOUT_GLOO_DIRECT_ALLREDUCE=0`` turns it off (gloo's allreduce then runs for every
size). A rank that turned it off says so in the collectives' consistency check, so ranks
that differ get an error, not a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from scaleout.core.pairwise import cpu_on_gloo

__all__ = ["ENV_VAR", "MAX_BYTES", "MAX_SENT_BYTES", "applies", "reduce_in_rank_order",
           "setting"]

ENV_VAR = "SCALEOUT_GLOO_DIRECT_ALLREDUCE"

#: The largest tensor reduced directly (128 KB at 2 ranks: 2.1x on loopback, 0.93x on the
#: 1 Gbit/s testbed, within the noise of the same call there; 240 KB: 0.82x).
MAX_BYTES = 128 * 1024
#: The most bytes a direct allreduce sends out of each rank, ``(ranks - 1) x`` the tensor's.
MAX_SENT_BYTES = 256 * 1024


def setting() -> tuple[str, ...]:
    """What the consistency check adds to an all-reduce's description: nothing when direct
    all-reduces are on (the default), ``direct_allreduce=off`` when this process turned them
    off (ranks that differ would run different collectives for one call)."""
    return ("direct_allreduce=off",) if os.environ.get(ENV_VAR, "1") == "0" else ()


def applies(group: Any, tensor: torch.Tensor, ranks: int) -> bool:
    """Whether an allreduce of ``tensor`` over ``ranks`` ranks of ``group`` is done directly:
    a CPU tensor of a real or integer dtype on a gloo group of 2 or more ranks, of at most
    :data:`MAX_BYTES`, ``ranks - 1`` copies of it at most :data:`MAX_SENT_BYTES`; never with
    ``SCALEOUT_GLOO_DIRECT_ALLREDUCE=0``. Every rank decides alike: it depends on the
    tensor's shape and dtype, which the consistency check compares, and on the group."""
    nbytes = tensor.numel() * tensor.element_size()
    if (ranks < 2 or tensor.device.type != "cpu" or tensor.dtype == torch.bool
            or tensor.is_complex() or nbytes > MAX_BYTES
            or (ranks - 1) * nbytes > MAX_SENT_BYTES
            or os.environ.get(ENV_VAR, "1") == "0"):
        return False
    return cpu_on_gloo(group)


def reduce_in_rank_order(received: torch.Tensor, out: torch.Tensor,
                         combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Reduce the rows of ``received`` (row ``i``: rank ``i``'s tensor, flat, this rank's own
    among them) into ``out`` in rank order, ``((r0 . r1) . r2) ...``, the same operands in the
    same order on every rank."""
    combine(received[0], received[1], out=out)
    for other in received[2:]:
        combine(out, other, out=out)
    return out
