"""The check that a replicated input is the same on every rank of a model group.

A column-parallel layer's input (and a row-parallel layer's whole input, a vocab-parallel
table's ids) must be equal on every rank of the model group: each rank multiplies it by its
block of the weight, and the blocks are joined or summed as if all had seen one input. Ranks
fed different samples (a loader sharded by global rank instead of DATA rank) or drawing
different random numbers before the layer (a dropout seeded per rank) raise nothing there:
they train a wrong model. So the ranks compare a fingerprint of such an input, on the
communicator's consistency schedule (``SCALEOUT_CHECK`` / ``init(check_consistency=...)``:
the first forward of each layer by default, every forward with ``"full"``, never with
``"off"``).

The fingerprint is three float64 numbers, one allgather: the element count, the norm and a
projection on a fixed pattern of signs (a multiplicative hash of the position, computed on
the tensor's device). Equal inputs give equal projections up to rounding (a different
summation order: ~1e-16 of the norm in float64 from float32 data); any difference ``d``
moves the projection by about ``|d|``, so the check reads ``|p_r - p_0| > 1e-4 * norm``.
Integer tensors (ids) compare exactly: another id is another row, however close its number.
Their projection is ``sum(x_i * w_i) mod p`` with ``p = 2^31 - 1`` (a prime) and distinct
weights ``w_i = c (i + 1) mod p``, computed in int64 without overflow and exact in float64;
one changed id, or two swapped, always changes it (for ids below ``p``: ``d * w_i`` and
``d (w_i - w_j)`` are not multiples of ``p``), any other change but for a chance of ``1 / p``.
The comparison needs the numbers on the host: a synchronisation, on checked forwards only.
"""

from __future__ import annotations

import math

import torch

from scaleout.core import collectives
from scaleout.core.collectives import Communicator

__all__ = ["check_replicated", "TOLERANCE"]

#: the projections of equal inputs differ by rounding only; far below any real difference
TOLERANCE = 1e-4
_HASH = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / golden ratio)
_PRIME = 2**31 - 1  # an integer tensor's projection is taken modulo this prime


def _exact(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds integers (or booleans), which must agree exactly."""
    return not (tensor.is_floating_point() or tensor.is_complex())


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    index = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    count = torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device)
    norm = torch.linalg.vector_norm(flat.to(torch.float64))
    if _exact(tensor):  # every factor below 2^31: no int64 overflow up to 2^32 elements
        weights = (index % (_PRIME - 1) + 1) * (_HASH % _PRIME) % _PRIME
        terms = flat.to(torch.int64).remainder(_PRIME) * weights % _PRIME
        return torch.stack([count, norm, (terms.sum() % _PRIME).to(torch.float64)])
    signs = 1.0 - 2.0 * ((index * _HASH >> 16) & 1).to(torch.float64)
    return torch.stack([count, norm, torch.dot(flat.to(torch.float64), signs)])


def _differs(mine: list[float], first: list[float], exact: bool = False) -> float | None:
    """The relative difference of two fingerprints, ``inf`` for different sizes or (``exact``:
    integer tensors) different values, ``None`` when they agree (non-finite inputs agree when
    equal: a NaN everywhere is not ours)."""
    if mine[0] != first[0]:
        return math.inf
    if exact:
        return None if mine[2] == first[2] else math.inf
    values = mine[1:] + first[1:]
    if not all(math.isfinite(v) for v in values):
        same = all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(mine, first))
        return None if same else math.inf
    gap = abs(mine[2] - first[2])
    scale = max(mine[1], first[1])
    return None if gap <= TOLERANCE * scale else gap / scale


def check_replicated(tensor: torch.Tensor, comm: Communicator, layer: str, what: str,
                     key: int) -> None:
    """Raise ValueError on every rank of ``comm`` unless ``tensor`` is the same on all of them.

    Runs when ``comm``'s consistency schedule asks for it (once per ``key`` and ``what`` by
    default); a model group of one rank never checks.

    Args:
        tensor: the input that must be replicated. comm: the model group.
        layer: the layer's kind and name, for the error. what: "input", "ids", ...
        key: tells the layer from others of the same name (its ``id``); local to this rank.

    Raises:
        ValueError: a rank's input differs from the group's first rank's; the message names
            both global ranks, the layer, the difference, and the two usual causes.
    """
    if comm.size == 1 or not comm.needs_check(f"replicated {what} of {layer} #{key}"):
        return
    with torch.no_grad():
        mine = _fingerprint(tensor).unsqueeze(0)
        every = collectives.allgather(comm, mine).wait().reshape(comm.size, 3).tolist()
    for member, fingerprint in enumerate(every[1:], start=1):
        gap = _differs(fingerprint, every[0], _exact(tensor))
        if gap is None:
            continue
        sizes = f"{int(every[0][0])} and {int(fingerprint[0])} elements"
        difference = ("different sizes" if every[0][0] != fingerprint[0]
                      else "different values" if math.isinf(gap)
                      else f"relative difference {gap:.3g}")
        raise ValueError(
            f"{layer}: different {what} on the ranks of the model group {comm.label} (global rank "
            f"{comm.ranks[member]} against {comm.ranks[0]}: {difference}; {sizes}). Every rank "
            f"of a model group must see the same samples and draw the same random numbers "
            f"before a tensor-parallel layer: feed the data by DATA rank (not by global rank) "
            f"and seed the ranks of a model group alike (e.g. torch.manual_seed(seed + "
            f"distribution.rank(GroupType.DATA))). SCALEOUT_CHECK=0 turns this check off.")
