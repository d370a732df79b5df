"""Horovod's reduction operations: ``hvd.Average``, ``Sum``, ``Adasum``, ``Min``, ``Max``, ``Product``."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "resolve_op"]


class ReduceOp(enum.IntEnum):
    """The reductions of Horovod's allreduce (same numbering as ``horovod.torch``)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def resolve_op(op: object, average: object, operation: str) -> ReduceOp:
    """The op a call asks for, from Horovod's ``op=`` or its deprecated ``average=``.

    Args:
        op: ``None`` or one of the ops (an int with the same value is accepted).
        average: ``None``, ``True`` (Average) or ``False`` (Sum); Horovod's older argument.
        operation: the collective's name, for error messages.

    Returns:
        The :class:`ReduceOp`; Average when neither is given.

    Raises:
        ValueError: both ``op`` and ``average`` are given, or ``op`` is not a known op.
    """
    if op is not None and average is not None:
        raise ValueError(f"{operation}: pass op= or the deprecated average=, not both "
                         f"(got op={op!r}, average={average!r})")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or not isinstance(op, int):
        raise ValueError(f"{operation}: op must be one of hvd.Average, Sum, Adasum, Min, Max, "
                         f"Product; got {op!r}")
    try:
        return ReduceOp(op)
    except ValueError as err:
        raise ValueError(f"{operation}: op must be one of hvd.Average, Sum, Adasum, Min, Max, "
                         f"Product (0..5); got {op!r}") from err
