"""Where a parameter lives on the grid: replicated (default), sharded over the model group, or
local to one rank.

Model-parallel layers mark their parameters here; :class:`~scaleout.pytorch.DataParallel`
reads the marks to register each parameter with its local size (a shard of a tensor split
across the model group) or to leave it alone (a table row-sharded or table-sharded across
ranks, updated by its own sparse optimizer), and :func:`~scaleout.pytorch.full_state_dict`
reads them to gather the full tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from scaleout.core.collectives import Communicator

__all__ = ["Kind", "Placement", "place", "placement_of", "is_local", "is_sharded", "registration"]

_ATTRIBUTE = "_scaleout_placement"


class Kind(enum.Enum):
    """``SHARDED``: split along ``dim`` across a model group (each rank one equal block).
    ``LOCAL``: held by one rank only, never exchanged by DataParallel."""

    SHARDED = "sharded"
    LOCAL = "local"


@dataclass(frozen=True, kw_only=True)
class Placement:
    """How one parameter is laid out.

    Attributes:
        kind: SHARDED or LOCAL.
        layer: the layer that owns it (for errors).
        comm: the group it is split across (SHARDED).
        dim: the split dimension (SHARDED).
        blocks: the full tensor is this many equal blocks stacked along ``dim`` (a fused
            ``[q; k; v]`` projection: 3), each split across the group; a rank's part is its
            slice of every block, in order (SHARDED).
    """

    kind: Kind
    layer: str
    comm: Communicator | None = None
    dim: int = 0
    blocks: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"Placement.kind must be a Kind, got {self.kind!r}")
        if self.kind is Kind.SHARDED and self.comm is None:
            raise ValueError(f"Placement of {self.layer}: a SHARDED parameter needs its group")
        if isinstance(self.blocks, bool) or not isinstance(self.blocks, int) \
                or self.blocks < 1:
            raise ValueError(f"Placement of {self.layer}: blocks must be an int >= 1, got "
                             f"{self.blocks!r}")

    @property
    def parts(self) -> int:
        """Into how many blocks the full tensor is split (1 for LOCAL)."""
        return self.comm.size if self.kind is Kind.SHARDED and self.comm is not None else 1

    def part_of(self, full: torch.Tensor, part: int) -> torch.Tensor:
        """Part ``part`` (a rank of the group) of the full tensor ``full``: its ``part``'th
        slice along ``dim`` of each of the ``blocks``, concatenated."""
        pieces = full.unflatten(self.dim, (self.blocks, self.parts, -1))
        return pieces.select(self.dim + 1, part).flatten(self.dim, self.dim + 1)

    def joined(self, parts: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's part concatenated along ``dim`` in rank order
        (what an allgather gives): the inverse of :meth:`part_of`."""
        pieces = parts.unflatten(self.dim, (self.parts, self.blocks, -1))
        return pieces.transpose(self.dim, self.dim + 1).flatten(self.dim, self.dim + 2)


def place(param: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Mark ``param`` with ``placement``; returns ``param``."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
    setattr(param, _ATTRIBUTE, placement)
    return param


def placement_of(param: torch.Tensor) -> Placement | None:
    """The mark of ``param``; ``None`` for a replicated parameter."""
    return getattr(param, _ATTRIBUTE, None)


def is_local(param: torch.Tensor) -> bool:
    """True for a parameter held by this rank alone (DataParallel leaves it alone)."""
    mark = placement_of(param)
    return mark is not None and mark.kind is Kind.LOCAL


def is_sharded(param: torch.Tensor) -> bool:
    """True for a tensor-parallel shard (a slice of a parameter split across the model group)."""
    mark = placement_of(param)
    return mark is not None and mark.kind is Kind.SHARDED


def registration(param: torch.Tensor, model_comm: Communicator) -> tuple[int, tuple[int, ...], bool]:
    """How DataParallel registers ``param``: ``(count, shape, model_split)`` of its
    ParameterSetSpec (a shard: the global count and shape, split across the model group;
    anything else: replicated over the model group, registered with its own size).

    Raises:
        ValueError: ``param`` is split across a model group other than ``model_comm``.
    """
    mark = placement_of(param)
    shape = tuple(param.shape)
    if mark is None or mark.kind is not Kind.SHARDED:
        return param.numel(), shape, False
    assert mark.comm is not None
    if tuple(mark.comm.ranks) != tuple(model_comm.ranks):
        raise ValueError(
            f"layer {mark.layer or '(unnamed)'} is split across the model group of ranks "
            f"{list(mark.comm.ranks)} ({mark.comm.size} parts), but this distribution's model "
            f"group is ranks {list(model_comm.ranks)} ({model_comm.size} parts): build the layer "
            "on the same distribution")
    full = list(shape)
    full[mark.dim] *= mark.parts
    return param.numel() * mark.parts, tuple(full), True
