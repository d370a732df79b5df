"""Random numbers inside split regions: a stream of its own on each rank of a model group.

The ranks of a model group are seeded alike, so that a dropout on a replicated activation
(after a row-parallel layer, after a spatial split's global pool) draws the same mask on
every one of them. Inside a split region (between a column and a row layer, on attention
heads split across ranks, on a spatial split's rows) each rank holds its own block of the
activation, and the same seeding made the blocks' masks equal: unit ``j`` of rank 0 and
unit ``j + n/p`` of rank 1 kept or dropped together. Megatron-LM forks the generator there
(``get_cuda_rng_tracker().fork()``, a state seeded ``seed + 2718 + tp_rank`` kept across
forks); so does :class:`ModelParallelRNG`, with the stream's seed taken afresh at each fork:

- ``with rng.fork(x.device):`` draws one number from torch's default CPU generator (the
  same on every rank of the model group, which are seeded alike and run the same forks),
  mixes it with the model-group rank into a seed, and puts generators seeded with it in
  place of the default ones (the CPU's, and the accelerator's for a device other than the
  CPU) until the block ends. Each fork draws fresh masks (the default stream moved on by
  one number), different on each model rank, the same again for the same seeds; data
  replicas seeded by data rank (``torch.manual_seed(seed + data_rank)``) differ too.
- Nothing is kept between forks: what replays the default CPU generator replays the masks.
  ``torch.utils.checkpoint`` recomputes a block under the CPU state it saved (the same
  masks, so the right gradients; a stream kept across forks, as Megatron's, needs a
  checkpoint function of its own), and ``scaleout.checkpoint`` saves that state.

:class:`SplitRegionDropout` is an ``nn.Dropout`` that draws under such a fork;
``tensor_parallel`` and ``spatial_parallel`` put it in place of the dropouts they see in a
split region. A dropout they cannot see (``F.dropout`` in a forward, a
``scaled_dot_product_attention`` with ``dropout_p``) runs under ``rng.fork()`` by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType

__all__ = ["ModelParallelRNG", "SplitRegionDropout", "split_seed"]

_MASK = (1 << 64) - 1
_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def split_seed(base: int, model_rank: int) -> int:
    """The seed of model-group rank ``model_rank``'s stream for ``base`` (the number a fork
    drew): a 64-bit mix, so that different ranks of one base never share a seed (the mix is
    a bijection), and ``(base + 1, rank 0)`` and ``(base, rank 1)`` are unrelated (``base +
    rank`` would make them equal)."""
    return _splitmix64(_splitmix64((base + _OFFSET) & _MASK) ^ model_rank)


def _device_rng(device: torch.device) -> Any:
    """The module holding ``get_rng_state``/``set_rng_state`` for ``device``'s type."""
    return torch.get_device_module(device.type)


class ModelParallelRNG:
    """Forks of torch's default generators to a stream of this rank's within a model group.

    Args:
        distribution: the grid; the streams differ across its MODEL group.

    With one rank in the model group there is no split region: :meth:`fork` changes
    nothing, and the model draws what the plain one would.

    Raises:
        TypeError: ``distribution`` is not a scaleout Distribution.

    Example (2 ranks, grid 1 x 2, both seeded ``torch.manual_seed(0)``):
        >>> rng = ModelParallelRNG(dist)
        >>> with rng.fork():
        ...     mask = torch.rand(4) < 0.5   # rank 0: one mask, rank 1: another
        >>> torch.rand(1)                     # the same on both ranks
    """

    def __init__(self, distribution: Distribution) -> None:
        if not isinstance(distribution, Distribution):
            raise TypeError(f"ModelParallelRNG: distribution must be a scaleout.Distribution, "
                            f"got {type(distribution).__name__}")
        comm = distribution.communicator(GroupType.MODEL)
        self.model_rank, self.model_parts, self.group = comm.rank, comm.size, comm.label
        self._forked = False  # a fork inside a fork draws on from the outer one's stream

    @contextlib.contextmanager
    def fork(self, device: torch.device | str | None = None) -> Iterator[None]:
        """Draw from a stream of this rank's inside the ``with`` block.

        Args:
            device: the tensors' device: the CPU generator is always forked, and this
                device's (current) generator too when it is another; default the current
                CUDA device when CUDA is initialised (no CUDA call otherwise).

        Raises:
            TypeError: ``device`` is not a device, a device string or None.
        """
        if isinstance(device, torch.fx.Proxy):  # traced by torch.fx: nothing is drawn
            yield
            return
        devices = [torch.device("cpu"), *self._accelerator(device)]
        if self.model_parts == 1 or self._forked:  # nothing split, or forked already
            yield
            return
        drawn = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))  # alike on the group
        seed = split_seed(drawn, self.model_rank)
        saved = [(d, self._get(d)) for d in devices]
        for d in devices:
            self._set(d, torch.Generator(device=d).manual_seed(seed).get_state())
        self._forked = True
        try:
            yield
        finally:
            self._forked = False
            for d, default in saved:
                self._set(d, default)

    def _accelerator(self, device: torch.device | str | None) -> list[torch.device]:
        if device is None:
            if not torch.cuda.is_initialized():
                return []
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, str):
            device = torch.device(device)
        elif not isinstance(device, torch.device):
            raise TypeError(f"ModelParallelRNG.fork: device must be a torch.device, a device "
                            f"string or None, got {type(device).__name__}")
        if device.type in ("cpu", "meta"):  # (meta tensors draw nothing)
            return []
        if device.index is None:
            device = torch.device(device.type, _device_rng(device).current_device())
        return [device]

    @staticmethod
    def _get(device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return torch.get_rng_state()
        return _device_rng(device).get_rng_state(device)

    @staticmethod
    def _set(device: torch.device, state: torch.Tensor) -> None:
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            _device_rng(device).set_rng_state(state, device)

    def __repr__(self) -> str:
        return f"ModelParallelRNG(model rank {self.model_rank} of {self.group})"


class SplitRegionDropout(nn.Dropout):
    """An ``nn.Dropout`` that draws its mask from a :class:`ModelParallelRNG`'s stream: in a
    split region each rank's block gets a mask of its own.

    Args:
        p / inplace: as for ``nn.Dropout``.
        rng: the stream (shared by the model's split-region dropouts).

    Raises:
        TypeError: ``rng`` is not a ModelParallelRNG.
        ValueError: ``p`` is not in [0, 1] (``nn.Dropout``'s check).
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, rng: ModelParallelRNG) -> None:
        super().__init__(p, inplace)
        if not isinstance(rng, ModelParallelRNG):
            raise TypeError(f"SplitRegionDropout: rng must be a ModelParallelRNG, got "
                            f"{type(rng).__name__}")
        self.rng = rng

    @classmethod
    def from_dropout(cls, dropout: nn.Dropout, rng: ModelParallelRNG) -> SplitRegionDropout:
        """``dropout``'s probability and mode on ``rng``'s stream."""
        new = cls(dropout.p, dropout.inplace, rng=rng)
        new.train(dropout.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:  # draws nothing
            return super().forward(input)
        with self.rng.fork(input.device):
            return super().forward(input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.rng!r}"
