"""Byte accounting: what one rank hands to collectives and what the ring model says it sends.

One module for the runtime's statistics, the codecs' exchange stats and the simulator.
Formulas: REFERENCES.md §3 (ring allreduce ``2 (p-1)/p n``, allgather ``(p-1) n``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["wire_bytes", "total_wire_bytes"]


def wire_bytes(kind: str, nbytes: int, ranks: int) -> float:
    """Bytes one rank sends for a collective under the ring model.

    Args:
        kind: ``"allreduce"`` (``2 (p-1)/p n``), ``"allgather"`` (``(p-1) n``, n per rank),
            ``"allgatherv"`` (``(p-1)/p n``, n the gathered total), ``"reduce_scatter"``
            (``(p-1)/p n``) or ``"alltoall"`` (``(p-1)/p n``).
        nbytes: bytes as described for each kind.
        ranks: group size ``p``.

    Returns:
        Estimated bytes sent by one rank (0 for a single rank).

    Raises:
        ValueError: for an unknown kind.
    """
    p = ranks
    if kind == "allreduce":
        return 2.0 * (p - 1) / p * nbytes
    if kind == "allgather":
        return float((p - 1) * nbytes)
    if kind in ("allgatherv", "reduce_scatter", "alltoall"):
        return (p - 1) / p * nbytes
    raise ValueError(f"wire_bytes: unknown collective {kind!r}; expected allreduce, allgather, "
                     "allgatherv, reduce_scatter or alltoall")


def total_wire_bytes(calls: Iterable[tuple[str, int]], ranks: int) -> float:
    """:func:`wire_bytes` summed over ``(kind, nbytes)`` calls."""
    return sum(wire_bytes(kind, nbytes, ranks) for kind, nbytes in calls)
