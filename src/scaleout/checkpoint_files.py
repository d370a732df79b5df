"""The files of a :mod:`scaleout.checkpoint`: one per rank in a version directory, written
atomically (temp file, fsync, rename), committed by rank 0 when the directory holds exactly
one save's files (a symbolic link renamed over the checkpoint's path), read back with
``weights_only=True``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from scaleout.checkpoint_agree import IncompleteCheckpointError

__all__ = ["write_atomic", "fsync_dir", "empty_directory", "commit", "world_of", "read"]


def write_atomic(target: Path, payload: Mapping[str, Any]) -> None:
    """``torch.save`` to a temp file in ``target``'s directory, fsync, rename over target."""
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(temp, "wb") as handle:
        torch.save(dict(payload), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, target)
    fsync_dir(target.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def empty_directory(fresh: Path) -> None:
    """Make ``fresh`` an empty directory (rank 0; the others write after it is done)."""
    if fresh.exists():
        shutil.rmtree(fresh)
    fresh.mkdir(parents=True)
    fsync_dir(fresh.parent)


def commit(path: Path, versions: Path, fresh: Path, world: int) -> None:
    """Point ``path`` at ``fresh`` once it holds exactly this save's files, then remove the
    older versions (rank 0)."""
    found = sorted(p.name for p in fresh.iterdir() if not p.name.startswith("."))
    expected = sorted(f"rank-{r}-of-{world}.pt" for r in range(world))
    if found != expected:
        raise IncompleteCheckpointError(
            f"checkpoint {path}: version directory {fresh} holds {found}, not {expected}; "
            f"not committed (the previous version, if any, is kept)")
    link = path.with_name(f".{path.name}.link-{os.getpid()}")
    if link.is_symlink():
        link.unlink()
    os.symlink(os.path.relpath(fresh, path.parent), link)
    os.replace(link, path)  # the commit: one atomic rename
    fsync_dir(path.parent)
    for old in versions.iterdir():
        if old != fresh:
            shutil.rmtree(old, ignore_errors=True)


def world_of(current: Path) -> int:
    """The world size of the checkpoint in version directory ``current``."""
    sizes = {int(m.group(1)) for p in current.glob("rank-*-of-*.pt")
             if (m := re.fullmatch(r"rank-\d+-of-(\d+)\.pt", p.name))}
    if len(sizes) != 1:
        raise ValueError(f"checkpoint directory {current} holds files of world sizes "
                         f"{sorted(sizes)}; expected one")
    return sizes.pop()


def read(current: Path, rank: int, world: int,
         map_location: str | torch.device | None) -> dict[str, Any]:
    file = current / f"rank-{rank}-of-{world}.pt"
    if not file.exists():
        raise IncompleteCheckpointError(f"checkpoint file {file} is missing (the checkpoint is "
                                        f"incomplete); nothing was restored")
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, corrupt, refused by weights_only
        reason = (str(err).strip().splitlines() or [""])[0][:300]
        raise IncompleteCheckpointError(f"checkpoint file {file} cannot be read "
                                        f"({type(err).__name__}: {reason}); nothing was "
                                        f"restored") from err
