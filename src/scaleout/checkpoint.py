"""Atomic, per-rank checkpoints: what training needs to continue bit-identically.

``save(path, model, optimizer, step=...)`` writes one file per rank holding *that rank's*
state: the model's ``state_dict()`` (with a :class:`~scaleout.pytorch.DataParallel`, its
extra state: every codec's error-feedback residuals, which differ by rank), the optimizer's
``state_dict()`` (a sharded update's slices differ by rank too), the RNG states (torch, CUDA,
Python, NumPy), the step and ``extra``. ``load(path, model, optimizer)`` restores them at the
same world size, or re-partitions them at another (below).

Layout and atomicity: ``path`` is a symbolic link to a version directory
``<path>.versions/<n>``. Rank 0 empties the new version directory (a save killed before its
commit leaves files there), then each rank writes ``rank-<r>-of-<N>.pt`` into it (a temp file
in the same directory, fsync, rename); after every rank is done, rank 0 checks that it holds
exactly those files, points ``path`` at it by renaming a new link over it (one atomic
rename) and removes older versions. A step that fails on some ranks only fails on every rank
with the same error (:mod:`scaleout.checkpoint_agree`); ``load`` checks the state against the
model and the optimizer before it modifies either (:mod:`scaleout.checkpoint_checks`). A kill at any moment leaves ``path`` naming a complete
checkpoint: the previous one until the rename, the new one after it.

Another world size: a checkpoint taken at N ranks loads at M ranks when the model is
replicated (no tensor-parallel or rank-local parameters; the data group is the whole job).
The weights are rank 0's; the optimizer state is rank 0's on exact paths (it is the same on
every rank) and, for the sharded update (``distributed_update=True``), every rank's owned
slices joined and cut again for M ranks (:mod:`scaleout.pytorch.resharding`; also from
unsharded to sharded and back). Codecs' error-feedback residuals are per-rank corrections with
no owner at another size: they are reset (a ``UserWarning`` says so). RNG states: rank r < N
takes old rank r's, the others keep theirs. :func:`consolidate` gives the joined state.

Why not ``torch.distributed.checkpoint``: it writes into the target directory in place (a
kill mid-save destroys the previous checkpoint unless the caller versions directories, which
is what this module does), and its planner exchanges metadata with ``gather_object``, i.e. a
pickle on the wire, which this library refuses. Its re-sharding is for DTensor/FSDP layouts;
scaleout's owned slices are flat blocks of each parameter, and joining them is a ``cat``
(reading the N files is the only cost). Files are read with ``weights_only=True``: loading a
checkpoint never runs code from it.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn

from scaleout.checkpoint_agree import (
    IncompleteCheckpointError,
    agree_on_version,
    agreed,
    first_exchange,
)
from scaleout.checkpoint_checks import (
    check_extra,
    check_extra_states,
    check_model,
    check_optimizer,
    optimizer_class,
    warn_untracked,
)
from scaleout.checkpoint_files import commit, empty_directory, read, world_of, write_atomic
from scaleout.core.grid import GroupType
from scaleout.pytorch.placement import placement_of
from scaleout.pytorch.resharding import (
    consolidate_optimizer_state,
    optimizer_shapes,
    shard_group,
    split_optimizer_state,
)
from scaleout.pytorch.sharded_update import refuse_wrapped

__all__ = ["save", "load", "consolidate", "IncompleteCheckpointError"]

_VERSIONS = ".versions"


def _rank_world() -> tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


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


def _current(path: Path) -> Path | None:
    """The version directory ``path`` names, or None when there is no checkpoint yet."""
    if path.is_symlink():
        target = Path(os.readlink(path))
        if target.parent.name == path.name + _VERSIONS and target.name.isdigit():
            return path.parent / target
    if path.exists() or path.is_symlink():
        raise ValueError(f"checkpoint path {path} exists and is not a scaleout checkpoint "
                         f"(a symbolic link to a version directory {path.name}{_VERSIONS}/<n>)")
    return None


def _model_parts(model: nn.Module) -> int:
    """The size of ``model``'s model group (1 for anything but a DataParallel on a grid)."""
    distribution = getattr(model, "distribution", None)
    return 1 if distribution is None else distribution.size(GroupType.MODEL)


def _synchronize(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Finish pending gradient communication and lazy updates: of ``model``, and of the
    DataParallel that ``optimizer`` steps when ``model`` is the module it wraps (else they
    would land on the weights just loaded, or be missing from the weights saved).

    Before the first exchange (since stop 52): in overlap mode the last buckets may still be
    on the progress thread, and a comm hook may send them on the default group, the group of
    the exchanges (torch's ``fp16_compress_hook`` with ``state=None`` does); started from two
    threads, the two collectives reached that group in an order that could differ by rank,
    and both ranks waited out the timeout in the first exchange."""
    for owner in (model, getattr(optimizer, "model", None)):
        sync = getattr(owner, "synchronize", None)
        if callable(sync):
            sync()


def save(path: str | os.PathLike[str], model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, step: int = 0,
         extra: Mapping[str, Any] | None = None) -> Path:
    """Save this rank's state; every rank of the job must call it (it meets the others).

    Args:
        path: the checkpoint's name (a symbolic link that this function creates or moves).
        model: the model (a DataParallel saves its codecs' residuals as extra state).
        optimizer: its optimizer (any ``torch.optim.Optimizer``, or scaleout's wrapper).
            Trainable parameters it does not hold (a second optimizer's) are named in a
            ``UserWarning`` unless ``extra`` holds an optimizer's ``state_dict()``.
        step: the training step, returned by :func:`load`.
        extra: more of this rank's state (tensors, numbers, strings, lists, dicts): what
            :func:`load` (``weights_only=True``) accepts; another optimizer's ``state_dict()``.

    Returns:
        The version directory written.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``step`` not an int.
        ValueError: ``path`` exists but is not a checkpoint, the ranks see different
            versions of it, or ``extra`` holds a value that ``load`` would refuse (the entry
            and its type are named; on every rank, nothing is written).
        RuntimeError: not every rank called it (the first exchange timed out).

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
    _synchronize(model, optimizer)  # (before any exchange: see _synchronize)
    # every rank writes into the same new version (a rank that saw another would write where
    # the commit does not point)
    first_exchange("save", agree_on_version, path, current, 0, "nothing was saved")
    fresh = versions / str(int(current.name) + 1 if current is not None else 0)
    payload = agreed(lambda: _payload(model, optimizer, step, extra, rank, world))
    warn_untracked(model, optimizer, extra)
    # a save killed before its commit left files (of another world size, perhaps) there
    agreed(lambda: empty_directory(fresh) if rank == 0 else None)
    agreed(lambda: write_atomic(fresh / f"rank-{rank}-of-{world}.pt", payload))
    agreed(lambda: commit(path, versions, fresh, world) if rank == 0 else None)
    return fresh  # (nobody starts another save, or a load, before the commit)


def _payload(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
             extra: Mapping[str, Any] | None, rank: int, world: int) -> dict[str, Any]:
    check_extra(extra or {})
    shards = shard_group(optimizer)
    return {
        "format": 1, "rank": rank, "world_size": world, "step": step,
        "layout": {"replicated": all(placement_of(p) is None for p in model.parameters()),
                   "model_parts": _model_parts(model),
                   "shards": shards[0] if shards else None,
                   "shapes": optimizer_shapes(optimizer) if optimizer is not None else None,
                   "optimizer_class": optimizer_class(optimizer)},
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "rng": _rng_state(), "extra": dict(extra or {}),
    }


def load(path: str | os.PathLike[str], model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *,
         map_location: str | torch.device | None = "cpu") -> tuple[int, dict[str, Any]]:
    """Restore this rank's state saved by :func:`save`, at its world size or another one.

    At the world size it was saved at (and the same sharding), each rank reads its own file.
    Otherwise the state is re-partitioned (see the module's notes): the model must be
    replicated, codec residuals are reset with a ``UserWarning``. Every rank of the job calls
    it (under a process group): before anything is restored the ranks check that they read
    the same version of ``path``, that every rank read its file, and that the state fits the
    model and the optimizer (keys and shapes, optimizer class, groups): a refused load leaves
    both as they were, on every rank.

    Returns:
        ``(step, extra)`` as saved (at another world size, rank 0's ``extra``).

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        IncompleteCheckpointError: (a ValueError) a rank's file is missing or unreadable; on
            every rank, naming the file.
        ValueError: it cannot be re-partitioned (tensor-parallel or rank-local parameters, a
            model group, a file from before layouts were recorded), does not fit the model or
            the optimizer (another optimizer class, other groups, no optimizer state), or the
            ranks see different versions of it (on every rank; nothing is restored).
        RuntimeError: not every rank called it (the first exchange timed out).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rank, world = _rank_world()
    path = Path(path)
    current = _current(path)
    saved_world = world_of(current) if current is not None else 0
    _synchronize(model, optimizer)  # (before any exchange: see _synchronize)
    first_exchange("load", agree_on_version, path, current, saved_world)
    if current is None:
        raise FileNotFoundError(f"no checkpoint at {path}")
    plan = agreed(lambda: _plan(path, current, saved_world, model, optimizer, map_location))
    model.load_state_dict(plan["model"])
    if optimizer is not None:
        optimizer.load_state_dict(plan["optimizer"])
    if plan["rng"] is not None:
        _set_rng_state(plan["rng"])
    return plan["step"], plan["extra"]


def _plan(path: Path, current: Path, saved_world: int, model: nn.Module,
          optimizer: torch.optim.Optimizer | None,
          map_location: str | torch.device | None) -> dict[str, Any]:
    """What :func:`load` restores on this rank, read and checked (nothing modified yet)."""
    rank, world = _rank_world()
    refuse_wrapped(optimizer)  # (one that holds no state: before anything is restored)
    shards = shard_group(optimizer)
    own = read(current, rank, saved_world, map_location) if rank < saved_world else None
    layout = own.get("layout") if own is not None else None  # None: written before layouts
    if layout is not None and not layout["replicated"] and \
            layout.get("model_parts", 1) != _model_parts(model):
        raise ValueError(f"checkpoint {path} holds tensor-parallel or rank-local parameters "
                         f"split over model groups of {layout.get('model_parts', 1)}: it loads "
                         f"only on such a grid, not on model groups of {_model_parts(model)}")
    if saved_world == world and own is not None and (
            layout is None or layout["shards"] == (shards[0] if shards else None)):
        payload, model_state, optimizer_state = own, own["model"], own["optimizer"]
        saved_class = (layout or {}).get("optimizer_class")
        saved_shapes = (layout or {}).get("shapes")
    else:
        if saved_world == world and layout is not None and not layout["replicated"]:
            # (only the sharding changed; consolidating said "loads only at world size N",
            # at that very world size)
            raise ValueError(f"checkpoint {path} holds tensor-parallel or rank-local "
                             f"parameters, saved {_sharding(layout['shards'])}; it loads only "
                             f"with that sharding, not {_sharding(shards[0] if shards else None)}"
                             f" (set distributed_update as when it was saved)")
        payload = _consolidate(path, current, map_location)
        if shards is not None and shards[0] != world:
            raise ValueError(f"cannot re-partition checkpoint {path} for a sharded update over "
                             f"{shards[0]} of {world} ranks (a model group): resume with the "
                             f"sharding it was saved with (distributed_update as then) at world "
                             f"size {saved_world}")
        same_ranks = saved_world == world and own is not None  # only the sharding changed
        model_state = own["model"] if same_ranks else \
            _reset_codec_state(payload["model"], saved_world, world)
        optimizer_state, saved_class = payload["optimizer"], payload["optimizer_class"]
        saved_shapes = payload["optimizer_shapes"]
        if optimizer_state is not None and shards is not None:
            optimizer_state = split_optimizer_state(optimizer_state, optimizer_shapes(optimizer),
                                                    *shards)
    check_model(path, model, model_state)
    check_extra_states(path, model, model_state)
    check_optimizer(path, optimizer, optimizer_state, saved_class, saved_shapes)
    return {"model": model_state, "optimizer": optimizer_state,
            "rng": own["rng"] if own is not None else None,
            "step": int(payload["step"]), "extra": dict(payload["extra"])}


def _sharding(shards: int | None) -> str:
    return "without a sharded update" if shards is None else \
        f"with a sharded update over {shards} rank{'s' if shards != 1 else ''}"


def consolidate(path: str | os.PathLike[str], *,
                map_location: str | torch.device | None = "cpu") -> dict[str, Any]:
    """The checkpoint at ``path`` as one unsharded state (no process group needed).

    Returns:
        ``{"step", "extra", "world_size", "model", "optimizer", "optimizer_class",
        "optimizer_shapes"}``: rank 0's model state (with rank 0's codec residuals, if any) and
        ``extra``; the optimizer state of an unsharded optimizer (a sharded update's slices
        joined); ``None`` without one; the optimizer's class (``module.name``) and its
        parameters' shapes in state-index order (None if not recorded).

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        IncompleteCheckpointError: (a ValueError) a rank's file is missing or unreadable.
        ValueError: the model is not replicated, or the checkpoint predates layouts.
    """
    path = Path(path)
    current = _current(path)
    if current is None:
        raise FileNotFoundError(f"no checkpoint at {path}")
    return _consolidate(path, current, map_location)


def _consolidate(path: Path, current: Path,
                 map_location: str | torch.device | None) -> dict[str, Any]:
    saved_world = world_of(current)
    first = read(current, 0, saved_world, map_location)
    layout = first.get("layout")
    if layout is None:
        raise ValueError(f"checkpoint {path} was written before layouts were recorded: it "
                         f"loads only at world size {saved_world}")
    if not layout["replicated"]:
        raise ValueError(f"checkpoint {path} holds tensor-parallel or rank-local parameters "
                         f"(different on every rank): it loads only at world size {saved_world}")
    optimizer = first["optimizer"]
    if optimizer is not None and layout["shards"] is not None:
        if layout["shards"] != saved_world:
            raise ValueError(f"checkpoint {path} has a sharded update over {layout['shards']} "
                             f"of {saved_world} ranks (a model group): it loads only with that "
                             f"sharding (distributed_update as then), at world size "
                             f"{saved_world}")
        states = [optimizer] + [read(current, r, saved_world, map_location)["optimizer"]
                                for r in range(1, saved_world)]
        optimizer = consolidate_optimizer_state(states, [tuple(s) for s in layout["shapes"]])
    return {"step": int(first["step"]), "extra": dict(first["extra"]),
            "world_size": saved_world, "model": first["model"], "optimizer": optimizer,
            "optimizer_class": layout.get("optimizer_class"),
            "optimizer_shapes": layout.get("shapes")}


def _reset_codec_state(state: Mapping[str, Any], saved_world: int,
                       world: int) -> dict[str, Any]:
    """``state`` with every DataParallel's codec state reset (a warning names the buckets):
    error-feedback residuals belong to the ranks that made them."""
    fresh = dict(state)
    reset = []
    for key, value in state.items():
        if key.endswith("_extra_state") and isinstance(value, dict) and value.get("compression"):
            reset += list(value["compression"])
            fresh[key] = {**value, "compression": {
                name: {"states": {name: {"step": 0, "buffers": {}}}}
                for name in value["compression"]}}
    if reset:
        warnings.warn(f"checkpoint saved at {saved_world} ranks, loaded at {world}: the codec "
                      f"state (error-feedback residuals) of {len(reset)} bucket(s) is reset, as "
                      f"it belongs to the ranks that made it ({reset[0]}, ...)", UserWarning,
                      stacklevel=6)  # (the caller of load)
    return fresh
