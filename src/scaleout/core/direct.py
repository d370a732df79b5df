"""Small allreduces over gloo as one exchange: every rank sends its whole tensor to every
other rank and reduces what it receives, in rank order.

Gloo's ring allreduce pays a fixed cost per call that dwarfs a small tensor's transfer: it
cuts the tensor into segments and runs a reduce-scatter and an all-gather over them, each
step a message and a wake-up of gloo's threads (strace: 12 ``writev`` and ~26 ``futex`` per
allreduce of 64 KB at 2 ranks). One ``all_to_all_single`` of ``p`` copies of the tensor is
one message to each peer, but gloo's all-to-all sends before it receives (a pair's two
directions may run one after the other, where the ring's run at once), and from 3 ranks it
moves more bytes than the ring (``(p - 1) n`` against ``2 (p - 1) / p n``). So it pays where
the fixed cost outweighs the wire, and the bounds (:data:`MAX_BYTES`) are where it paid on
every link measured (``benchmarks/allreduce_probe.py``, benchmarks/RESULTS.md, "Small
allreduces in one exchange", stop 28), gloo's time / this one's:

* 2 ranks, up to 96 KB: loopback 2.7-3.0x; 1 Gbit/s 1.4-3.3x; 100 Mbit/s 1.0-4.1x (128 KB:
  0.93x at 1 Gbit/s, 0.82x at 100 Mbit/s);
* 3 ranks, up to 16 KB: loopback 2.7x, 1 Gbit/s 2.9x, 100 Mbit/s 1.4-3.0x (32 KB: 0.76x at
  100 Mbit/s);
* from 4 ranks: not measured here, so gloo's ring.

Every rank reduces the same ``p`` tensors in the same order (rank 0's first), so the results
are equal bit for bit on every rank, as gloo's are; they may differ from gloo's in the last
bits (another summation order).

``SCALEOUT_GLOO_DIRECT_ALLREDUCE=0`` turns it off (gloo's allreduce then runs for every
size). A rank that turned it off says so in the collectives' consistency check, so ranks
that differ get an error, not a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch

from scaleout.core.pairwise import cpu_on_gloo

__all__ = ["ENV_VAR", "MAX_BYTES", "applies", "reduce_in_rank_order", "setting"]

ENV_VAR = "SCALEOUT_GLOO_DIRECT_ALLREDUCE"

#: The largest tensor reduced directly, by group size (sizes not listed: never).
MAX_BYTES = MappingProxyType({2: 96 * 1024, 3: 16 * 1024})


def setting() -> tuple[str, ...]:
    """What the consistency check adds to an all-reduce's description: nothing when direct
    all-reduces are on (the default), ``direct_allreduce=off`` when this process turned them
    off (ranks that differ would run different collectives for one call)."""
    return () if _on() else ("direct_allreduce=off",)


def _on() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


def applies(group: Any, tensor: torch.Tensor, ranks: int) -> bool:
    """Whether an allreduce of ``tensor`` over ``ranks`` ranks of ``group`` is done directly:
    a CPU tensor of a real or integer dtype on a gloo group, of at most
    ``MAX_BYTES[ranks]``; never with ``SCALEOUT_GLOO_DIRECT_ALLREDUCE=0``. Every rank decides
    alike: it depends on the tensor's shape and dtype, which the consistency check compares,
    and on the group."""
    if (tensor.device.type != "cpu" or tensor.dtype == torch.bool or tensor.is_complex()
            or tensor.numel() * tensor.element_size() > MAX_BYTES.get(ranks, -1)
            or not _on()):
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
