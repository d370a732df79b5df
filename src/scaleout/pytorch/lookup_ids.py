"""The rows a batch looked up, handed to the row-sparse exchange so it need not search for them.

:mod:`scaleout.pytorch.lookup_reads` sends a weight read by embedding lookups alone with the
lossless ``rows`` codec, whose first round is every rank's flag per touched row. Found in
the gradient, those flags cost a pass over every table (DLRM's 5 MB: ``|x|`` summed per row)
between the end of backward and the exchange, on the two cores the ranks compute on. The
forward knows them already: each lookup's backward node keeps the indices it read.
:class:`LookupRows` reads them at every training forward (one walk over the forward's
graph, ~0.3 us a node here: DLRM's 0.026 ms) and hands each row-sparse bucket's
next exchange a flag per row (:data:`~scaleout.compression.rows.ROWS_TOUCHED`). DLRM at
10 Gbit/s, 2 ranks, five-round pairs: 1.06-1.09x DDP before, 1.16-1.17x after
(benchmarks/RESULTS.md, stop 39).

Exact in every case: the flags must cover every row whose gradient is not zero. They do when,
at every forward since the bucket's last exchange, each of its weights

* was read by embedding lookups alone in that forward's graph (each with its indices saved,
  dense: ``sparse=False``): their gradient is zero outside those rows;
* had no gradient yet (``.grad`` is ``None``: ``zero_grad()``'s default; a gradient kept
  from before, or accumulated under ``no_sync()``, may hold other rows);
* has no hook that could change its gradient (a tensor hook, or a post-accumulate hook other
  than DataParallel's own).

Where one of these fails, the bucket's exchange finds the rows in the gradient, as before,
until its next exchange. What the forward cannot see, a term of the loss outside it that
reads the table (an L2 penalty: every row's gradient), the exchange checks in the gradient
(its non-zeros all in flagged rows, unless the gradient is seen to be the lookups' own: see
``_Bucket.settle``); on a miss it searches, and the bucket gets no more hints (before stop 48
such a penalty's gradient was dropped outside the looked-up rows, 0.22 off). A forward whose
graph is never backpropagated adds its rows to those of the next: more rows sent, none
missed. (A hook on the weight's grad accumulator
node, which no public API registers, is not seen.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scaleout.compression import CodecState, RowsCodec
from scaleout.compression.rows import (ROWS_HINT_MISSED, ROWS_HINT_PROVEN, ROWS_SEARCH,
                                        ROWS_TOUCHED)
from scaleout.pytorch.lookup_reads import graph_readers, is_lookup
from scaleout.pytorch.modules import Layer
from scaleout.session import Session
from scaleout.session.hooks import CodecHookState

__all__ = ["LookupRows"]


@dataclass(eq=False)
class _Bucket:
    """One row-sparse bucket with flagged rows of lookup-only weights (and maybe others')."""

    state: CodecState  # the bucket's codec state: the hint goes into its scratch
    members: list[tuple[nn.Parameter, int]]  # each lookup-only weight and its first flag
    rows: int  # flags in all
    search: tuple[tuple[int, int], ...] = ()  # the other matrices' flags: (first, count)
    seen_step: int = -1  # the codec state's exchanges at the last forward
    valid: bool = True  # every forward since the last exchange gave its rows
    # what each weight's lookups gave its gradient, (data_ptr, version) per contribution,
    # and the weights whose gradient is exactly that (:meth:`settle`), since the exchange
    given: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    proven: set[int] = field(default_factory=set)
    disproven: bool = False

    def observe(self, readers: dict[int, list[tuple[Any, int]]], own_hook: Callable) -> None:
        """Add this forward's rows to the hint, or drop it until the next exchange."""
        scratch = self.state.scratch
        if self.state.step != self.seen_step:  # an exchange since: it took (or left) the hint
            self._drop()
            self.valid, self.seen_step = True, self.state.step
            self.given, self.proven, self.disproven = {}, set(), False
        if scratch.get(ROWS_HINT_MISSED):  # the gradient had rows no lookup read: no more
            self.valid = False
        ids = self._looked_up(readers, own_hook) if self.valid else None
        if ids is None:
            self.valid = False
            self._drop()
            return
        for param, _ in self.members:
            for node, slot in readers.get(id(param), ()):
                node.register_hook(self._recorder(id(param), slot))
        flags = scratch.get(ROWS_TOUCHED)
        if flags is None:
            flags = scratch[ROWS_TOUCHED] = torch.zeros(self.rows, dtype=torch.bool,
                                                        device=ids.device)
            if self.search:  # (the exchange searches those rows for their flags)
                scratch[ROWS_SEARCH] = self.search
        flags[ids] = True

    def _drop(self) -> None:
        self.state.scratch.pop(ROWS_TOUCHED, None)
        self.state.scratch.pop(ROWS_SEARCH, None)
        self.state.scratch.pop(ROWS_HINT_PROVEN, None)

    def _recorder(self, key: int, slot: int) -> Callable[..., None]:
        """A lookup node's post-hook: note the gradient it hands the weight (no reference)."""
        def record(grad_inputs: tuple[Any, ...], _grad_outputs: Any) -> None:
            grad = grad_inputs[slot]
            if grad is not None:
                self.given.setdefault(key, []).append((grad.data_ptr(), grad._version))
        return record

    def settle(self, param: nn.Parameter) -> None:
        """``param``'s gradient is final (before it is sent): it is the sum of its lookups'
        alone when it is the very tensor one of them gave, changed since by nothing but the
        other lookups' additions (autograd adds into the first gradient in place: one version
        each). Anything else (a term of the loss outside the forward added in place, or out of
        place: another tensor) leaves the hint unproven, and the exchange counts the
        gradient's non-zeros instead. Proven for every weight: ``ROWS_HINT_PROVEN``."""
        grad, given = param.grad, self.given.get(id(param), [])
        if grad is None or not any(
                ptr == grad.data_ptr() and grad._version == version + len(given) - 1
                for ptr, version in given):
            self.disproven = True
            return
        self.proven.add(id(param))
        if not self.disproven and len(self.proven) == len(self.members):
            self.state.scratch[ROWS_HINT_PROVEN] = True

    def _looked_up(self, readers: dict[int, list[tuple[Any, int]]],
                   own_hook: Callable) -> torch.Tensor | None:
        """This forward's flag positions, or ``None`` where they may miss a row."""
        parts = []
        for param, first in self.members:
            if param.grad is not None or param._backward_hooks or not _own_hooks_only(
                    param, own_hook):
                return None
            for node, _ in readers.get(id(param), ()):
                if not is_lookup(node) or getattr(node, "_saved_sparse", False):
                    return None
                try:
                    indices = node._saved_indices
                except (AttributeError, RuntimeError):  # (freed, or another kind of node)
                    return None
                parts.append(indices.reshape(-1).to(torch.long) + first)
        if not parts:  # none of its weights was read: their gradients are zero
            return torch.empty(0, dtype=torch.long, device=self.members[0][0].device)
        return torch.cat(parts)


def _own_hooks_only(param: nn.Parameter, own_hook: Callable) -> bool:
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return not hooks or all(hook == own_hook for hook in hooks.values())


class LookupRows:
    """The row-sparse buckets of a committed ``session`` with flagged rows of weights read by
    lookups alone, and each forward's rows for them (module docstring); the bucket's other
    matrices (``rows`` named for every layer) are named for the exchange to search
    (:data:`~scaleout.compression.rows.ROWS_SEARCH`).

    Args:
        session: the committed session.
        layers: its layers (their parameters and parameter sets).
        lookup_only: ids of the parameters sent row-sparse because lookups alone read them.
        own_hook: DataParallel's post-accumulate-grad hook (any other hook on a weight
            turns its bucket's hint off).
    """

    def __init__(self, session: Session, layers: Iterable[Layer], lookup_only: Iterable[int],
                 own_hook: Callable) -> None:
        lookup_only = set(lookup_only)
        sets = {id(ps): p for layer in layers for p, ps in zip(layer.params, layer.sets)}
        self._buckets: list[_Bucket] = []
        for bucket in session.buckets:
            state = bucket.state
            if not isinstance(state, CodecHookState) or not isinstance(state.codec, RowsCodec):
                continue
            members, search, first = [], [], 0
            for ps, rows in zip(bucket.members, RowsCodec.row_counts(state.shapes)):
                param = sets.get(id(ps))
                if rows and (param is None or id(param) not in lookup_only):
                    search.append((first, rows))  # (no lookup says its rows: searched)
                elif rows:
                    members.append((param, first))
                first += rows
            if members:
                self._buckets.append(_Bucket(state.codec_state, members, first, tuple(search)))
        self._params = {id(p): p for b in self._buckets for p, _ in b.members}
        self._bucket_of = {id(p): b for b in self._buckets for p, _ in b.members}
        self._own_hook = own_hook

    def __bool__(self) -> bool:
        return bool(self._buckets)

    def settle(self, param: nn.Parameter) -> None:
        """``param``'s gradient is final and about to be sent (:meth:`_Bucket.settle`)."""
        bucket = self._bucket_of.get(id(param))
        if bucket is not None and ROWS_TOUCHED in bucket.state.scratch:
            bucket.settle(param)

    def observe(self, output: Any) -> None:
        """A training forward produced ``output``: hand its rows to the next exchanges (call
        it after every bucket's last exchange completed: its weights' updates ran)."""
        readers = graph_readers(output, self._params)
        for bucket in self._buckets:
            bucket.observe(readers, self._own_hook)
