"""MLSL's data x model process grid, described apart from the process groups that realise it.

A :class:`Grid` is a pure description (torchtitan's ``ParallelDims`` is the model): its
degrees, validated on construction, and which ranks form each group. Creating the groups is
:class:`~scaleout.core.distribution.Distribution`'s job.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["GroupType", "Grid", "grid_groups", "check_degrees"]


class GroupType(enum.Enum):
    """Which group of the grid a collective runs on.

    ``DATA``: ranks with the same weights and different samples (they exchange gradients).
    ``MODEL``: ranks holding different slices of the weights for the same samples (they
    exchange activations). ``GLOBAL``: the whole data x model grid of this rank.
    """

    DATA = "data"
    MODEL = "model"
    GLOBAL = "global"


def _check_degree(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_degrees(world_size: int, data_parts: object, model_parts: object) -> int:
    """``data_parts * model_parts`` after checking both are ints >= 1 that divide the world.

    Raises:
        TypeError: a degree is not an int.
        ValueError: a degree is < 1, or the grid does not divide the world size.
    """
    for name, value in (("data_parts", data_parts), ("model_parts", model_parts)):
        _check_degree(name, value)
    grid = data_parts * model_parts  # type: ignore[operator]
    if world_size % grid != 0:
        raise ValueError(
            f"data_parts * model_parts = {data_parts} * {model_parts} = {grid} must divide the "
            f"world size {world_size}"
        )
    return grid


def grid_groups(world_size: int, data_parts: int, model_parts: int) -> dict[GroupType, list[tuple[int, ...]]]:
    """Every group of the grid, as MLSL lays them out.

    Model groups are runs of ``model_parts`` consecutive ranks; data groups are strided by
    ``model_parts``. When ``data_parts * model_parts`` is smaller than the world, the ranks
    form ``world_size / (data_parts * model_parts)`` independent replicas of the grid.

    Raises:
        ValueError: the grid does not divide the world size.

    Example:
        >>> grid_groups(4, 2, 2)[GroupType.DATA]
        [(0, 2), (1, 3)]
    """
    grid = check_degrees(world_size, data_parts, model_parts)
    groups: dict[GroupType, list[tuple[int, ...]]] = {t: [] for t in GroupType}
    for base in range(0, world_size, grid):
        for d in range(data_parts):
            start = base + d * model_parts
            groups[GroupType.MODEL].append(tuple(range(start, start + model_parts)))
        for m in range(model_parts):
            groups[GroupType.DATA].append(tuple(range(base + m, base + grid, model_parts)))
        groups[GroupType.GLOBAL].append(tuple(range(base, base + grid)))
    return groups


@dataclass(frozen=True, kw_only=True)
class Grid:
    """A data x model grid over ``world_size`` ranks.

    Attributes:
        world_size: ranks in the job.
        data_parts: data-parallel degree (``-1``: world_size / model_parts).
        model_parts: model-parallel degree (consecutive ranks).

    Raises:
        TypeError / ValueError: a degree is not a positive int, or the grid does not divide
            the world size.

    Example:
        >>> Grid(world_size=4, data_parts=-1, model_parts=2).data_parts
        2
    """

    world_size: int
    data_parts: int = -1
    model_parts: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if self.data_parts in (None, -1):  # derived: the model degree is checked first
            _check_degree("model_parts", self.model_parts)
            object.__setattr__(self, "data_parts", max(self.world_size // self.model_parts, 1))
        check_degrees(self.world_size, self.data_parts, self.model_parts)  # O(1), not O(world)

    def groups(self) -> dict[GroupType, list[tuple[int, ...]]]:
        """Every group of the grid (see :func:`grid_groups`)."""
        return grid_groups(self.world_size, self.data_parts, self.model_parts)
