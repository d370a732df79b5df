"""The :class:`Workload` contract shared by every reference workload.

A workload bundles a model builder, a deterministic synthetic (or real) data
source and a loss. Everything is a pure function of its arguments: the same
``seed`` builds the same weights, the same ``(step, seed)`` yields the same
batch, on every rank and in every process. That is what lets a test compare
N-rank training with a single-process reference on the concatenated batch.

Batches are generated *globally* and then sliced: ``make_batch(B, step, seed,
rank=r, world_size=W)`` returns rows ``[r*B//W, (r+1)*B//W)`` of the batch that
``make_batch(B, step, seed)`` returns, so concatenating the slices of all ranks
in rank order reproduces the single-process batch exactly.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "Batch",
    "Workload",
    "batch_to",
    "build_seeded",
    "check_int",
    "make_generator",
    "shard_bounds",
    "shard_tensors",
]

Batch = tuple[Any, torch.Tensor]
"""``(inputs, targets)``; ``inputs`` is a tensor or a tuple of tensors."""

_MASK64 = (1 << 64) - 1
_T = TypeVar("_T")
_M = TypeVar("_M", bound=nn.Module)


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``.

    Raises:
        TypeError: naming ``name``, if ``value`` is not an int.
        ValueError: naming ``name``, if ``value < minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(*keys: int) -> torch.Generator:
    """Return a CPU generator seeded by a hash of ``keys``.

    Nearby keys such as ``(seed=1, step=0)`` and ``(seed=0, step=1)`` give
    unrelated streams, unlike seeding with ``seed + step``.

    Args:
        keys: non-negative integers, e.g. ``(seed, step)`` or a fixed salt.

    Returns:
        A fresh ``torch.Generator`` on the CPU.

    Raises:
        TypeError: if a key is not an int.
        ValueError: if a key is negative.
    """
    state = 0x5CA1E0
    for i, key in enumerate(keys):
        check_int(f"key {i}", key, 0)
        state = _splitmix64(state ^ (key & _MASK64))
    generator = torch.Generator()
    generator.manual_seed(state >> 1)  # 63 bits: always a valid seed
    return generator


def build_seeded(factory: Callable[[], _M], seed: int) -> _M:
    """Call ``factory()`` with torch's CPU RNG seeded, leaving the global RNG as it was.

    Args:
        factory: builds and initialises a module using torch's default RNG.
        seed: non-negative int.

    Returns:
        The module ``factory`` returned; identical weights for identical seeds.

    Raises:
        TypeError, ValueError: if ``seed`` is not a non-negative int.
    """
    check_int("seed", seed, 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def shard_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch that belong to ``rank``.

    Shards are contiguous, in rank order, and differ in size by at most one.

    Example:
        >>> [shard_bounds(7, r, 3) for r in range(3)]
        [(0, 2), (2, 4), (4, 7)]

    Raises:
        TypeError: if an argument is not an int.
        ValueError: if ``world_size < 1``, ``rank`` is outside
            ``[0, world_size)`` or ``batch_size < world_size`` (a rank would get
            an empty shard).
    """
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0)
    check_int("batch_size", batch_size, 1)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}")
    if batch_size < world_size:
        raise ValueError(
            f"batch_size ({batch_size}) must be >= world_size ({world_size}) so that "
            "every rank gets at least one sample"
        )
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


def _map_tensors(obj: _T, fn: Callable[[torch.Tensor], torch.Tensor]) -> _T:
    if isinstance(obj, torch.Tensor):
        return fn(obj)  # type: ignore[return-value]
    if isinstance(obj, tuple):
        parts = [_map_tensors(item, fn) for item in obj]
        if hasattr(obj, "_fields"):  # NamedTuple
            return type(obj)(*parts)  # type: ignore[return-value]
        return tuple(parts)  # type: ignore[return-value]
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(obj).__name__}")


def shard_tensors(obj: _T, start: int, stop: int) -> _T:
    """Copy rows ``[start, stop)`` of every tensor in ``obj`` (a tensor or nested tuple).

    The result owns its memory, so it does not keep the global batch alive.
    """
    return _map_tensors(obj, lambda t: t[start:stop].clone())


def batch_to(batch: _T, device: torch.device | str) -> _T:
    """Move every tensor in ``batch`` (a tensor or nested tuple) to ``device``."""
    return _map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class Workload(abc.ABC):
    """A model, its data and its loss, all deterministic.

    Subclasses are frozen keyword-only dataclasses; they implement
    :meth:`build_model`, :meth:`loss_fn` and :meth:`_global_batch` and provide
    ``name``, ``description`` and ``default_batch_size`` (samples *per rank*).

    Example:
        >>> from scaleout.workloads import get_workload
        >>> wl = get_workload("digits-mlp")
        >>> model = wl.build_model(seed=0)
        >>> x, y = wl.make_batch(64, step=0, seed=0, rank=1, world_size=2)
        >>> x.shape  # rank 1 holds rows 32..63 of the global batch
        torch.Size([32, 1, 8, 8])
        >>> wl.loss_fn(model(x), y).backward()
    """

    name: str
    description: str
    default_batch_size: int

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """Build the model with weights that depend only on ``seed``.

        Args:
            seed: non-negative int.

        Returns:
            A freshly initialised ``nn.Module`` on the CPU, in training mode;
            it takes one argument, ``model(inputs)``.

        Raises:
            TypeError, ValueError: if ``seed`` is not a non-negative int.
        """

    @abc.abstractmethod
    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of ``outputs = model(inputs)`` against ``targets`` (a scalar)."""

    @abc.abstractmethod
    def _global_batch(self, batch_size: int, step: int, seed: int) -> Batch:
        """The whole (unsharded) batch for ``(step, seed)``; arguments already validated."""

    def make_batch(
        self, batch_size: int, step: int, seed: int = 0, *, rank: int = 0, world_size: int = 1
    ) -> Batch:
        """Return ``rank``'s slice of the global batch number ``step``.

        Args:
            batch_size: *global* batch size, summed over ranks. A rank gets
                ``batch_size // world_size`` samples, or one more.
            step: iteration index, >= 0.
            seed: data seed, >= 0; same ``(step, seed)`` -> same batch.
            rank: which slice to return, in ``[0, world_size)``.
            world_size: number of slices.

        Returns:
            ``(inputs, targets)``. Concatenating ``inputs`` (tensor by tensor)
            and ``targets`` over ranks ``0..world_size-1`` gives exactly
            ``make_batch(batch_size, step, seed)``.

        Raises:
            TypeError: if an argument is not an int.
            ValueError: if an argument is out of range, or ``batch_size`` is
                smaller than ``world_size``.
        """
        start, stop = shard_bounds(batch_size, rank, world_size)
        check_int("step", step, 0)
        check_int("seed", seed, 0)
        inputs, targets = self._global_batch(batch_size, step, seed)
        if world_size == 1:
            return inputs, targets
        return shard_tensors(inputs, start, stop), shard_tensors(targets, start, stop)
