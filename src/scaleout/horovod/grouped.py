"""Horovod's ``grouped_allgather_async`` and ``grouped_reducescatter_async`` (since stop 52).

Each runs the single-tensor collective on every tensor of a list under one handle, as
``grouped_allreduce_async`` does (see :mod:`scaleout.horovod.group`): the members first agree
on the number of tensors, then each tensor is checked and moved on its own (no fusion
buffer), named ``<name>.<i>``. ``synchronize`` returns the list of outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scaleout.horovod.collectives import start_allgather, start_reducescatter
from scaleout.horovod.group import run_group
from scaleout.horovod.ops import ReduceOp
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["grouped_allgather_async", "grouped_reducescatter_async"]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of each tensor of ``tensors``; one handle for all of them.

    Tensor i of every member is concatenated along dim 0 with tensor i of the others; members
    may pass different numbers of rows, the other dims and the dtype must agree.

    Returns:
        The handle; ``synchronize`` returns the list of the concatenations.

    Raises:
        TypeError: ``tensors`` is not a list of tensors, or holds an unsupported dtype.
        TensorMismatchError: (on every member) the members pass different numbers of
            tensors, or tensors whose names, dtypes or trailing shapes differ.

    Example (2 ranks):
        >>> h = hvd.grouped_allgather_async([torch.full((hvd.rank() + 1,), hvd.rank()),
        ...                                  torch.ones(1, 2)])
        >>> hvd.synchronize(h)
        [tensor([0, 1, 1]), tensor([[1., 1.], [1., 1.]])]
    """
    kind = "grouped_allgather"
    return run_group(tensors, lambda rt, t, n: start_allgather(rt, t, n, process_set, kind),
                     name, process_set, kind)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of ``tensors``; one handle for all of them.

    Each tensor is reduced over the set (``hvd.Average`` by default, as Horovod) and member i
    keeps the i-th block of its dim 0, the first ``rows % size`` members one row more.

    Returns:
        The handle; ``synchronize`` returns the list of this member's blocks.

    Raises:
        TypeError: ``tensors`` is not a list of tensors, an unsupported dtype, or a scale
            factor that is not a number.
        ValueError: an op other than Average, Sum, Min or Max, or a 0-d tensor.
        TensorMismatchError: (on every member) the members pass different numbers of
            tensors, or differ in names, op, dtypes, shapes or scale factors.

    Example (2 ranks):
        >>> h = hvd.grouped_reducescatter_async([torch.ones(3), torch.ones(2, 2)], op=hvd.Sum)
        >>> hvd.synchronize(h)   # rank 0; rank 1: [tensor([2.]), tensor([[2., 2.]])]
        [tensor([2., 2.]), tensor([[2., 2.]])]
    """
    kind = "grouped_reducescatter"
    return run_group(tensors, lambda rt, t, n: start_reducescatter(
        rt, t, n, op, process_set, prescale_factor, postscale_factor, kind),
        name, process_set, kind, joinable=False)
