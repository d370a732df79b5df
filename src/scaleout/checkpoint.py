"""Atomic, per-rank checkpoints: what training needs to continue bit-identically.

``save(path, model, optimizer, step=...)`` writes one file per rank holding *that rank's*
state: the model's ``state_dict()`` (with a :class:`~scaleout.pytorch.DataParallel`, its
extra state: every codec's error-feedback residuals, which differ by rank), the optimizer's
``state_dict()`` (a sharded update's slices differ by rank too), the RNG states (torch, CUDA,
Python, NumPy), the step and ``extra``. ``load(path, model, optimizer)`` restores them at the
same world size.

Layout and atomicity: ``path`` is a symbolic link to a version directory
``<path>.versions/<n>``. Each rank writes ``rank-<r>-of-<N>.pt`` into a new version
directory (a temp file in the same directory, fsync, rename); after every rank is done,
rank 0 points ``path`` at the new version by renaming a new link over it (one atomic
rename) and removes older versions. A kill at any moment leaves ``path`` naming a complete
checkpoint: the previous one until the rename, the new one after it.

Why not ``torch.distributed.checkpoint``: it writes into the target directory in place (a
kill mid-save destroys the previous checkpoint unless the caller versions directories, which
is what this module does), and its planner exchanges metadata with ``gather_object``, i.e. a
pickle on the wire, which this library refuses. Files are read with ``weights_only=True``:
loading a checkpoint never runs code from it.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn

__all__ = ["save", "load"]

_VERSIONS = ".versions"


def _rank_world() -> tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()  # bounded by the process group's timeout


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(internal), gauss_py],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss_py = state["python"]
    random.setstate((version, tuple(internal), gauss_py))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _write_atomic(target: Path, payload: Mapping[str, Any]) -> None:
    """``torch.save`` to a temp file in ``target``'s directory, fsync, rename over target."""
    temp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(temp, "wb") as handle:
        torch.save(dict(payload), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, target)
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _current(path: Path) -> Path | None:
    """The version directory ``path`` names, or None when there is no checkpoint yet."""
    if path.is_symlink():
        return path.parent / os.readlink(path)
    if path.exists():
        raise ValueError(f"checkpoint path {path} exists and is not a scaleout checkpoint "
                         "(a symbolic link to a version directory)")
    return None


def _synchronize(model: nn.Module) -> None:
    sync = getattr(model, "synchronize", None)
    if callable(sync):
        sync()  # finish pending gradient communication and lazy updates


def save(path: str | os.PathLike[str], model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, step: int = 0,
         extra: Mapping[str, Any] | None = None) -> Path:
    """Save this rank's state; every rank of the job must call it (it meets the others).

    Args:
        path: the checkpoint's name (a symbolic link that this function creates or moves).
        model: the model (a DataParallel saves its codecs' residuals as extra state).
        optimizer: its optimizer (any ``torch.optim.Optimizer``, or scaleout's wrapper).
        step: the training step, returned by :func:`load`.
        extra: more of this rank's state (tensors, numbers, strings, lists, dicts).

    Returns:
        The version directory written.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``step`` not an int.
        ValueError: ``path`` exists but is not a checkpoint.

    Example:
        >>> checkpoint.save("ckpt/run", model, opt, step=step)        # every rank
        >>> step = checkpoint.load("ckpt/run", model, opt)            # on resume
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    rank, world = _rank_world()
    path = Path(path)
    versions = path.with_name(path.name + _VERSIONS)
    current = _current(path)
    number = int(current.name) + 1 if current is not None else 0
    fresh = versions / str(number)
    fresh.mkdir(parents=True, exist_ok=True)
    _synchronize(model)
    payload = {
        "format": 1, "rank": rank, "world_size": world, "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": _rng_state(), "extra": dict(extra or {}),
    }
    _write_atomic(fresh / f"rank-{rank}-of-{world}.pt", payload)
    _barrier()  # every rank's file is on disk
    if rank == 0:
        link = path.with_name(f".{path.name}.link-{os.getpid()}")
        if link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(fresh, path.parent), link)
        os.replace(link, path)  # the commit: one atomic rename
        _fsync_dir(path.parent)
        for old in versions.iterdir():
            if old != fresh:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()  # nobody starts another save (or a load) before the commit
    return fresh


def load(path: str | os.PathLike[str], model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *,
         map_location: str | torch.device | None = "cpu") -> tuple[int, dict[str, Any]]:
    """Restore this rank's state saved by :func:`save` (at the same world size).

    Returns:
        ``(step, extra)`` as saved.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``, or none for this rank.
        ValueError: it was saved at another world size.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rank, world = _rank_world()
    path = Path(path)
    current = _current(path)
    if current is None:
        raise FileNotFoundError(f"no checkpoint at {path}")
    mine = current / f"rank-{rank}-of-{world}.pt"
    if not mine.exists():
        saved = sorted(p.name for p in current.glob("rank-*.pt"))
        raise ValueError(f"checkpoint {path} was not saved at world size {world} for rank "
                         f"{rank} (it holds {saved}); resume at the world size it was saved at")
    payload = torch.load(mine, map_location=map_location, weights_only=True)
    _synchronize(model)
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"checkpoint {path} holds no optimizer state")
        optimizer.load_state_dict(payload["optimizer"])
    _set_rng_state(payload["rng"])
    return int(payload["step"]), dict(payload["extra"])
