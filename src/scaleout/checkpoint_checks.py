"""What :mod:`scaleout.checkpoint` checks before it writes or restores anything.

- at save: that ``extra`` survives the ``weights_only=True`` load (:func:`check_extra`), and
  which trainable parameters the optimizer does not hold (:func:`warn_untracked`: their
  optimizer's state is not in the checkpoint unless it travels in ``extra``);
- at load: that the model state fits the model (keys, shapes, the extra states its modules
  check) and the optimizer state the optimizer (its class, its groups) (:func:`check_model`,
  :func:`check_extra_states`, :func:`check_optimizer`), so that a refused load leaves model
  and optimizer as they were.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaleout.pytorch.resharding import optimizer_shapes

__all__ = ["check_extra", "warn_untracked", "check_model", "check_extra_states",
           "check_optimizer", "optimizer_class"]


def _round_trips(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means: it does not load
        return False
    return True


def _offending(value: Any, where: str) -> tuple[str, str]:
    """The innermost entry of ``value`` that does not round-trip, and its type's name."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not _round_trips(key):
                return f"{where} key {key!r}", type(key).__name__
            if not _round_trips(item):
                return _offending(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if not _round_trips(item):
                return _offending(item, f"{where}[{index}]")
    return where, f"{type(value).__module__}.{type(value).__qualname__}"


def check_extra(extra: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first entry of ``extra`` that ``load`` would refuse."""
    if _round_trips(dict(extra)):
        return
    where, kind = _offending(dict(extra), "extra")
    raise ValueError(f"checkpoint.save: {where} is a {kind}, which checkpoint.load "
                     f"(torch.load with weights_only=True) refuses; store plain values instead "
                     f"(a float or a tensor for a NumPy value, str() of a path; tensors, numbers, "
                     f"strings, lists, dicts). Nothing was written")


def _holds_optimizer_state(extra: Mapping[str, Any] | None) -> bool:
    """Whether ``extra`` (or a dict in it) holds an optimizer's ``state_dict()``."""
    values = list((extra or {}).values())
    values += [v for d in values if isinstance(d, Mapping) for v in d.values()]
    return any(isinstance(v, Mapping) and "state" in v and "param_groups" in v for v in values)


def _outside(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """Ids of ``model``'s trainable parameters that ``optimizer`` does not step."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    updates = getattr(model, "updates", None)
    if getattr(optimizer, "model", None) is model and updates is not None:
        # a DistributedOptimizer of this DataParallel (with the sharded update its groups hold
        # slices): the model knows what is outside it, and what it never registered
        registered = {id(p) for layer in model.layers for p in layer.params}
        return set(updates.outside) | (trainable - registered)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return trainable - held


def _updated_in_backward(model: nn.Module) -> set[int]:
    """Ids of parameters whose update state the model's own state holds (an
    EmbeddingCollection's tables updated in backward: its extra state says by what rule)."""
    ids: set[int] = set()
    for module in model.modules():
        if module is model or type(module).get_extra_state is nn.Module.get_extra_state:
            continue
        try:
            state = module.get_extra_state()
        except Exception:  # noqa: BLE001 - not ours to judge here
            continue
        if isinstance(state, Mapping) and state.get("update_in_backward") is not None:
            ids |= {id(p) for p in module.parameters()}
    return ids


def warn_untracked(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: Mapping[str, Any] | None) -> None:
    """Warn when trainable parameters are outside ``optimizer`` and ``extra`` holds no other
    optimizer's state: a resumed run would restart that optimizer's state from zero."""
    if optimizer is None or _holds_optimizer_state(extra):
        return
    outside = _outside(model, optimizer)
    if outside:
        outside -= _updated_in_backward(model)
    names = [name for name, p in model.named_parameters() if id(p) in outside]
    if names:
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        warnings.warn(
            f"checkpoint.save: trainable parameters {', '.join(names[:2])}{more} are not held by "
            f"the optimizer given, so the state of the optimizer that steps them (a second "
            f"optimizer, e.g. RowWiseAdagrad for embedding tables) is not saved; pass its "
            f"state_dict() in extra (extra={{'tables': other.state_dict()}}) and load it back "
            f"from the extra that checkpoint.load returns", UserWarning, stacklevel=3)


def optimizer_class(optimizer: torch.optim.Optimizer | None) -> str | None:
    """The optimizer's class, ``module.name`` (a DistributedOptimizer's: the wrapped one's)."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner", None)
    kind = type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def check_model(path: Path, model: nn.Module, state: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``state`` has ``model``'s keys, each tensor at its shape."""
    expected = model.state_dict()
    problems = []
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        problems.append(f"missing keys {missing[:4]}" + (" ..." if len(missing) > 4 else ""))
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:4]}"
                        + (" ..." if len(unexpected) > 4 else ""))
    problems += [f"{k}: {tuple(state[k].shape)} saved, {tuple(v.shape)} in this model"
                 for k, v in expected.items() if isinstance(v, torch.Tensor)
                 and isinstance(state.get(k), torch.Tensor) and state[k].shape != v.shape][:4]
    if problems:
        raise ValueError(f"checkpoint {path} does not fit this model ({'; '.join(problems)}); "
                         f"nothing was restored")


def check_extra_states(path: Path, model: nn.Module, state: Mapping[str, Any]) -> None:
    """Raise ValueError unless every module of ``model`` that can say so
    (``check_extra_state(state)``: DataParallel, EmbeddingCollection) takes its extra state
    in ``state``: ``load_state_dict`` would meet a refusal only after the modules before it
    were loaded."""
    for name, module in model.named_modules():
        check = getattr(module, "check_extra_state", None)
        key = f"{name}._extra_state" if name else "_extra_state"
        if callable(check) and key in state:
            try:
                check(state[key])
            except ValueError as err:
                raise ValueError(f"checkpoint {path} does not fit this model ({key}: {err}); "
                                 f"nothing was restored") from None


def check_optimizer(path: Path, optimizer: torch.optim.Optimizer | None,
                    state: Mapping[str, Any] | None, saved_class: str | None,
                    saved_shapes: list[Any] | None = None) -> None:
    """Raise ValueError unless ``state`` loads into ``optimizer``: state present, the same
    class and parameter shapes (when the checkpoint records them), the same groups of the
    same sizes."""
    if optimizer is None:
        return
    if state is None:
        raise ValueError(f"checkpoint {path} holds no optimizer state (it was saved without an "
                         f"optimizer): load it with optimizer=None; nothing was restored")
    mine = optimizer_class(optimizer)
    if saved_class is not None and saved_class != mine:
        raise ValueError(f"checkpoint {path} holds the state of a {saved_class} optimizer; "
                         f"this optimizer is a {mine} (their states differ); nothing was "
                         f"restored")
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    saved = [len(group["params"]) for group in state["param_groups"]]
    if sizes != saved:
        raise ValueError(f"checkpoint {path}: the optimizer's parameter groups hold {saved} "
                         f"parameters there and {sizes} here; nothing was restored")
    if saved_shapes is None:  # (older checkpoints record none)
        return
    here = optimizer_shapes(optimizer)
    for index, (there, shape) in enumerate(zip(saved_shapes, here)):
        if tuple(there) != tuple(shape):  # the state of other parameters: the step would fail
            raise ValueError(f"checkpoint {path}: the optimizer's parameter {index} has shape "
                             f"{tuple(there)} there and {tuple(shape)} here (an optimizer over "
                             f"other parameters); nothing was restored")
