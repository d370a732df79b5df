"""A loader wrapper that prefetches each next batch's ids into an EmbeddingCollection."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["prefetching"]

_B = TypeVar("_B")


def prefetching(batches: Iterable[_B], collection: Any,
                ids: Callable[[_B], torch.Tensor]) -> Iterator[_B]:
    """Yield ``batches`` unchanged, prefetching the ids of batch ``i + 1`` before yielding
    batch ``i``, so that their exchange travels while batch ``i`` trains.

    Every rank of the data group iterates its own batches (the same number of them). The
    loop body must pass each batch's ids to the collection's forward once, in order; when
    the loop stops early, call ``collection.drain()`` on every rank.

    Args:
        batches: any iterable of batches (a DataLoader, a list).
        collection: the :class:`~scaleout.pytorch.EmbeddingCollection` the ids are for.
        ids: picks a batch's ``(B, T)`` ids (``lambda batch: batch[0].sparse`` for DLRM's
            ``(DLRMInputs, targets)``).

    Returns:
        An iterator over the same batches.

    Raises:
        TypeError: ``ids`` is not callable, or ``collection`` has no ``prefetch``.

    Example (each rank):
        >>> for inputs, targets in prefetching(loader, model.embeddings,
        ...                                    ids=lambda batch: batch[0].sparse):
        ...     loss_fn(model(inputs), targets).backward()   # forward takes the prefetched ids
        ...     optimizer.step(); optimizer.zero_grad()
    """
    if not callable(ids):
        raise TypeError(f"prefetching: ids must pick a batch's ids (a callable), got "
                        f"{type(ids).__name__}")
    if not callable(getattr(collection, "prefetch", None)):
        raise TypeError(f"prefetching: collection must be an EmbeddingCollection, got "
                        f"{type(collection).__name__}")
    return _pipeline(iter(batches), collection, ids)


def _pipeline(batches: Iterator[_B], collection: Any,
              ids: Callable[[_B], torch.Tensor]) -> Iterator[_B]:
    try:
        current = next(batches)
    except StopIteration:
        return
    collection.prefetch(ids(current))
    for following in batches:
        collection.prefetch(ids(following))
        yield current
        current = following
    yield current
