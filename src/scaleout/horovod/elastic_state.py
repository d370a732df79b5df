"""Horovod's elastic state objects on scaleout's restarts: ``State``, ``ObjectState``,
``TorchState``.

As in Horovod, ``commit()`` keeps a copy of the state in memory (``restore()`` returns to
it) and ``sync()`` gives every rank rank 0's state. Unlike Horovod, a failed rank is not
replaced inside the running job: ``scaleout run --max-restarts K`` restarts every rank. So
``commit()`` also persists the state with :func:`scaleout.checkpoint.save` under
``$SCALEOUT_STATE_DIR/hvd-elastic`` (one file per rank, committed atomically), and
:func:`scaleout.horovod.elastic.run` resumes a restarted job from the last commit.
``commit()`` is collective: every rank commits at the same points (Horovod scripts do).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from scaleout import checkpoint
from scaleout.horovod.compression import CodecCompression
from scaleout.horovod.context import rank, size
from scaleout.horovod.elastic_sampler import ElasticSampler
from scaleout.horovod.objects import broadcast_object, encode_object
from scaleout.horovod.parameters import broadcast_optimizer_state, broadcast_parameters
from scaleout.launch.restarts import STATE_DIR_VAR, state_dir

__all__ = ["State", "ObjectState", "TorchState", "CHECKPOINT_NAME"]

#: The checkpoint's name in ``$SCALEOUT_STATE_DIR`` (one elastic state per job).
CHECKPOINT_NAME = "hvd-elastic"


class State:
    """The base of elastic states: reset callbacks, commit, and persistence of commits.

    Subclasses implement :meth:`save`, :meth:`restore`, :meth:`sync` and say what a commit
    persists (:meth:`_modules`, :meth:`_extra`, :meth:`_load_extra`).

    Args:
        bcast_object: how to broadcast a plain object from rank 0 (default
            :func:`scaleout.horovod.broadcast_object`).
        get_rank: this process's rank (default :func:`scaleout.horovod.rank`).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object if bcast_object is not None else broadcast_object
        self._get_rank = get_rank if get_rank is not None else rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._warned = False

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) when the job resumes after a restart.

        Raises:
            TypeError: one of them is not callable.
        """
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callbacks must be callable, got "
                                f"{type(callback).__name__}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (done by ``hvd.elastic.run`` after a restart)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state in memory and persist it for a restarted job (collective)."""
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod's host check; hosts never change while a scaleout job runs, so this never
        raises ``HostsUpdatedInterrupt``."""

    def save(self) -> None:
        """Keep a copy of the current state in memory."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Return to the state of the last :meth:`save` or :meth:`commit`."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Give every rank rank 0's state (collective)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")

    def reset(self) -> None:
        """Horovod's hook after the job was re-formed; nothing to do at the same size."""

    # -- persistence ----------------------------------------------------------------

    def _modules(self) -> tuple[nn.Module, Any]:
        """(model, optimizer or None) that a commit persists and a resume loads."""
        raise NotImplementedError(f"{type(self).__name__} must implement _modules()")

    def _extra(self) -> dict[str, Any]:
        """The rest that a commit persists (collective: every rank commits)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _extra()")

    def _load_extra(self, extra: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _load_extra()")

    def _path(self) -> Path | None:
        directory = state_dir(os.environ)
        return Path(directory) / CHECKPOINT_NAME if directory else None

    def _persist(self) -> None:
        path = self._path()
        if path is None:
            if not self._warned:
                warnings.warn(f"hvd.elastic: {STATE_DIR_VAR} is not set (scaleout run sets it), "
                              "so commits are kept in memory only and a restarted job starts "
                              "from the beginning", RuntimeWarning, stacklevel=3)
                self._warned = True
            return
        model, optimizer = self._modules()
        extra = self._extra()
        for group in extra.values():  # a TypeError now, naming the value, not at the resume
            for name, value in group.items():
                encode_object(value, f"hvd.elastic commit of {name!r}")
        checkpoint.save(path, model, optimizer, extra=extra)

    def resume(self) -> bool:
        """Load the last persisted commit, if there is one (every rank). Returns whether.

        Raises:
            ValueError: (on every rank) the ranks see different commits, or none on some.
        """
        path = self._path()
        if path is None:
            return False
        model, optimizer = self._modules()
        try:  # every rank loads: load checks that all of them see the same commit (or none)
            _, extra = checkpoint.load(path, model, optimizer)
        except FileNotFoundError:
            if path.is_symlink():  # a commit whose file is missing: not "no commit"
                raise
            return False
        self._load_extra(extra)
        self.save()
        return True


class ObjectState(State):
    """Plain values (numbers, strings, tensors, lists/dicts of them) as attributes.

    Example:
        >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
        >>> state.epoch += 1; state.commit()
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._saved_state = dict(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _modules(self) -> tuple[nn.Module, Any]:
        return nn.Module(), None

    def _extra(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def _load_extra(self, extra: dict[str, Any]) -> None:
        self._saved_state = dict(extra["objects"])
        self._set_attrs()


class TorchState(ObjectState):
    """A model, an optimizer, objects with ``state_dict``/``load_state_dict`` (an
    ``ElasticSampler``, an LR scheduler) and plain values.

    Args:
        model: the ``nn.Module`` (or None).
        optimizer: its optimizer, e.g. ``hvd.DistributedOptimizer`` (or None).
        **kwargs: objects with ``state_dict()``/``load_state_dict()``, and plain values.

    Example:
        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    """

    def __init__(self, model: nn.Module | None = None, optimizer: Any = None,
                 **kwargs: Any) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not hasattr(optimizer, "load_state_dict"):
            raise TypeError(f"optimizer must be a torch optimizer, got "
                            f"{type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        # a codec's error-feedback residuals belong with the weights they correct: committed,
        # restored and persisted with them, per rank (never synced from rank 0)
        codec = getattr(optimizer, "compression", None)
        self._codec = codec if isinstance(codec, CodecCompression) else None
        self._stateful = {name: value for name, value in kwargs.items()
                          if hasattr(value, "state_dict") and hasattr(value, "load_state_dict")}
        plain = {name: value for name, value in kwargs.items() if name not in self._stateful}
        for name, value in self._stateful.items():
            setattr(self, name, value)
        super().__init__(**plain)
        self._saved_torch: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        if self.model is not None:
            self._saved_torch["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_torch["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        for name, value in self._stateful.items():
            self._saved_torch[name] = copy.deepcopy(value.state_dict())
        if self._codec is not None:
            self._saved_torch[_CODEC] = self._codec.state_dict()
        super().save()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_torch["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_torch["optimizer"])
        for name, value in self._stateful.items():
            value.load_state_dict(self._saved_torch[name])
        if self._codec is not None:
            self._codec.load_state_dict(self._saved_torch[_CODEC])
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for value in self._stateful.values():
            sync = getattr(value, "sync", None)  # an ElasticSampler merges every rank's progress
            if callable(sync):
                sync()
            else:
                value.load_state_dict(self._bcast_object(value.state_dict()))
        super().sync()

    def _modules(self) -> tuple[nn.Module, Any]:
        return self.model if self.model is not None else nn.Module(), self.optimizer

    def _extra(self) -> dict[str, Any]:
        # an ElasticSampler persists every rank's progress (merged_state_dict): a job resumed
        # at another number of ranks loads rank 0's commit on every rank, and before stop 51
        # that held rank 0's processed samples only, so the others' were trained on again
        stateful = {name: (value.merged_state_dict() if isinstance(value, ElasticSampler)
                           else value.state_dict())
                    for name, value in self._stateful.items()}
        extra = {"objects": self._saved_state, "stateful": stateful}
        if self._codec is not None:
            extra[_CODEC] = {"rank": rank(), "size": size(),
                             "states": self._saved_torch[_CODEC]}
        return extra

    def _load_extra(self, extra: dict[str, Any]) -> None:
        for name, value in self._stateful.items():
            value.load_state_dict(extra["stateful"][name])
        if self._codec is not None:
            self._codec.load_state_dict(_own_residuals(extra.get(_CODEC)))
        super()._load_extra(extra)


#: where a TorchState keeps its optimizer's codec residuals (in memory and in a commit)
_CODEC = "codec residuals"  # (not a valid keyword: no user state shares the name)


def _own_residuals(saved: dict[str, Any] | None) -> dict[str, Any]:
    """The codec states of a persisted commit that are this rank's: none when the commit has
    none, or when it was made at another size (the checkpoint then gives every rank rank 0's,
    and adding one rank's residuals on every rank would count them that many times)."""
    if saved is None:
        return {}
    if (saved["rank"], saved["size"]) != (rank(), size()):
        warnings.warn(f"hvd.elastic: the commit was made at {saved['size']} ranks, resumed at "
                      f"{size()}: the codec's error-feedback residuals start afresh",
                      UserWarning, stacklevel=4)
        return {}
    return saved["states"]

