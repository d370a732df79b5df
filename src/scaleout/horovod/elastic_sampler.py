"""Horovod's ``hvd.elastic.ElasticSampler``: a distributed sampler that remembers which
samples of the epoch were already processed, so a resumed job does not repeat them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from scaleout.horovod.context import rank, size
from scaleout.horovod.objects import allgather_object, broadcast_object

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler[int]):
    """Each rank's share of the samples of this epoch not yet processed by any rank.

    Record progress with :meth:`record_batch` (or :meth:`record_indices`) and put the
    sampler in a ``TorchState``: a commit keeps the processed indices, and after a restart
    :meth:`sync` merges every rank's and re-partitions the rest.

    Args:
        dataset: anything with ``len()``.
        shuffle: a new permutation each epoch (seeded by ``seed + epoch``, the same on every
            rank).
        seed: the shuffling seed.

    Example:
        >>> sampler = hvd.elastic.ElasticSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must have a length, got {type(dataset).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` with nothing processed; the current epoch again (what a
        resumed script does first) keeps the recorded progress."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (of ``batch_size`` samples) of this rank as processed."""
        start = batch_idx * batch_size
        self.record_indices(self.indices[start:start + batch_size])

    def record_indices(self, indices: list[int]) -> None:
        """Mark these dataset indices as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of this rank's batch ``batch_idx``."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def merged_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with the indices processed by every rank (collective).

        A ``TorchState`` commit persists this: a job resumed at another number of ranks
        loads rank 0's commit on every rank, which then holds every rank's progress.
        """
        merged: set[int] = set()
        for indices in allgather_object(sorted(self.processed_indices)):
            merged.update(indices)
        return {"epoch": self.epoch, "processed_indices": sorted(merged)}

    def sync(self) -> None:
        """Every rank's processed indices merged, rank 0's epoch; then re-partition."""
        self.load_state_dict(broadcast_object(self.merged_state_dict()))

    def reset(self) -> None:
        """Partition the samples not yet processed across the ranks (padded to equal size)."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        # repeated as often as needed: fewer samples may be left than there are ranks
        padded = (remaining * self.num_replicas)[:total]
        self.indices = padded[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
