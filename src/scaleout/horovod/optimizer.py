"""Horovod's ``DistributedOptimizer``: gradients are averaged as backward produces them.

A hook on each parameter (``register_post_accumulate_grad_hook``) starts the parameter's
non-blocking allreduce as soon as its gradient is accumulated, so communication overlaps the
rest of backward; ``step()`` (or ``synchronize()``) waits for all of them, then runs the
wrapped optimizer. Unlike Horovod it wraps the optimizer instead of building a subclass at
run time: it *is* a ``torch.optim.Optimizer`` (LR schedulers accept it) sharing the wrapped
optimizer's ``param_groups`` and ``state``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from scaleout.horovod.allreduce import start_allreduce
from scaleout.horovod.compression import Compression
from scaleout.horovod.context import runtime
from scaleout.horovod.handles import submit, synchronize
from scaleout.horovod.ops import Average, ReduceOp, resolve_op
from scaleout.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["DistributedOptimizer"]


def _noname(group: int, index: int) -> str:
    """Horovod's name of parameter ``index`` of param group ``group`` when none is given."""
    return f"allreduce.noname.{group}.{index}"


def _names(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict[torch.Tensor, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:  # Horovod's names, apart from those of unnamed allreduces
        return {p: _noname(i, j) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    pairs = list(named_parameters)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError("named_parameters must be (name, parameter) pairs, as "
                         "model.named_parameters() gives")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"named_parameters holds duplicate names: {twice}")
    by_param = {p: name for name, p in pairs}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters does not name {len(unnamed)} of the optimizer's "
                         "parameters: pass model.named_parameters() of the model the optimizer "
                         "was built for")
    return {p: by_param[p] for p in params}


def _check_groups(num_groups: object, groups: object) -> None:
    """Horovod's checks of ``num_groups`` and ``groups`` (which have no effect here: before
    stop 51 anything passed, where Horovod raises ValueError)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups > 0):
        return
    if not isinstance(groups, list):
        raise ValueError(f"groups must be a positive int or a list of lists of parameters, got "
                         f"{groups!r}")
    seen: set[int] = set()
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups must be a list of lists of parameters, got a "
                             f"{type(group).__name__} where a list was expected")
        bad = next((p for p in group if not isinstance(p, torch.Tensor)), None)
        if bad is not None:
            raise ValueError(f"groups must be a list of lists of parameters (torch.Tensor), got "
                             f"a {type(bad).__name__} where a parameter was expected")
        for p in group:
            if id(p) in seen:
                raise ValueError("groups names a parameter twice: a parameter can be in one "
                                 "group only")
            seen.add(id(p))


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over the ranks.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names the allreduces (recommended;
            without it, parameter j of param group i is ``allreduce.noname.i.j``).
        compression: ``hvd.Compression.none``, ``.fp16`` or ``hvd.Compression.codec(spec)``.
        backward_passes_per_step: backward passes whose gradients accumulate locally before
            one allreduce (gradient accumulation).
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum`` (Adasum of the gradients).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups, groups, sparse_as_dense: accepted for compatibility; no effect (each
            gradient travels on its own; sparse gradients are always made dense, as
            ``sparse_as_dense=True`` does in Horovod).
        process_set: the ranks to average over; on a rank outside it, ``step()`` applies the
            rank's own gradients, as in Horovod.

    Raises:
        ValueError: bad names, ``backward_passes_per_step < 1``, a non-positive predivide
            factor, a predivide factor with an op other than Average, or ``groups`` that is
            neither a positive int nor a list of lists of parameters (each at most once).
        NotInitialized: before ``hvd.init()``, or ``process_set`` is not registered.

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                named_parameters=model.named_parameters())
        >>> loss.backward(); opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                             f"{backward_passes_per_step!r}")
        op = resolve_op(op, None, "DistributedOptimizer")
        _check_groups(num_groups, groups)
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average, got "
                             f"op={op.name}")
        world_size = runtime().env.world_size  # (NotInitialized before hvd.init())
        process_set.require_registered("DistributedOptimizer")
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer = optimizer
        self._names = _names(optimizer, named_parameters)
        self._compression = compression
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        # outside the set (or alone) a rank steps on its own gradients, as in Horovod
        self._averages = world_size > 1 and process_set.included()
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in self._names}
        self._handles: dict[torch.Tensor, int | None] = {}  # None: accumulated, not yet sent
        self._should_synchronize = True
        self._synchronized = False
        self._hooks: list[Any] = []  # the hook handles, kept alive with the optimizer
        if self._averages:
            for p in self._names:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        self._wrapping = True  # (add_param_group adds to the wrapped optimizer from now on)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters are averaged like the others
        (named ``allreduce.noname.<group>.<index>``; every rank must add the same group).
        Before stop 51 they got no hook: never averaged, the ranks' copies parted silently
        (as in Horovod, whose optimizer does not follow added groups either)."""
        if not getattr(self, "_wrapping", False):  # (torch's __init__ adds the groups)
            super().add_param_group(param_group)
            return
        self._optimizer.add_param_group(param_group)  # (the groups' list is shared)
        index = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[index]["params"]):
            self._names[p] = _noname(index, j)
            self._delay[p] = self.backward_passes_per_step
            if self._averages and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _start(self, p: torch.Tensor) -> int:
        if p.grad is None:  # not used this step here, maybe elsewhere: contribute zeros
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:  # (an Embedding with sparse=True) averaged dense, as
            p.grad = p.grad.to_dense()  # Horovod's sparse_as_dense=True does
        rt = runtime()
        pre, post = 1.0, 1.0
        if self._op is Average:
            pre, post = 1.0 / self._predivide, self._predivide
        return submit(rt, start_allreduce(
            rt, p.grad, name=self._names[p], op=self._op, prescale=pre, postscale=post,
            compression=self._compression, process_set=self._process_set))

    def _hook(self, p: torch.Tensor) -> None:
        if self._handles.get(p) is not None and self._delay[p] <= 0:
            raise RuntimeError(
                f"the gradient of {self._names[p]!r} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before step(); "
                "raise backward_passes_per_step to accumulate gradients locally")
        self._delay[p] -= 1
        self._handles[p] = self._start(p) if self._delay[p] == 0 else None

    def synchronize(self) -> None:
        """Wait until every gradient is averaged (starting the allreduce of any not started)."""
        if self._averages:
            for p in self._names:
                if p.requires_grad and self._handles.get(p) is None:
                    self._handles[p] = self._start(p)
            for p, handle in list(self._handles.items()):
                synchronize(handle)
        self._handles.clear()
        self._delay = {p: self.backward_passes_per_step for p in self._names}
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not synchronize (after an explicit ``synchronize()``).

        Example:
            >>> opt.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with opt.skip_synchronize():
            ...     opt.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Synchronize (unless in :meth:`skip_synchronize`), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() outside "
                              "optimizer.skip_synchronize(): the gradients are averaged again",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refuses while gradients wait to be averaged.

        Raises:
            RuntimeError: called between ``backward()`` and ``step()``/``synchronize()``,
                including between the passes of ``backward_passes_per_step > 1`` (it would
                drop the gradients accumulated so far), as Horovod refuses.
        """
        if self._handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are "
                               "still being accumulated or averaged")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def compression(self) -> Any:
        """The compression the gradients travel with (``hvd.Compression.none`` by default)."""
        return self._compression

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (a codec compression's residuals are the
        compression's own: ``hvd.elastic.TorchState`` commits them per rank)."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self._optimizer.load_state_dict(state_dict)
        self.param_groups = self._optimizer.param_groups
        self.state = self._optimizer.state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"
