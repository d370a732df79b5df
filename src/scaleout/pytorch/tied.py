"""Tied embeddings: a weight read by an embedding lookup *and* by other operations travels
in two shares, the others' share early and the lookup's share row-sparse.

A language model that ties its LM head to its token embedding (GPT-2's layout) reads one
weight twice: the head's product at the end of forward, the lookup at its start. Autograd
sums both gradients at the leaf, so the weight's gradient exists only when backward ends,
and it is needed first by the next forward: its whole exchange lies in the open. Yet the
head's share exists at the start of backward, dense, while the lookup's share, which
arrives last, is zero outside the rows of the batch's tokens.

:class:`EarlyShares` keeps the two apart. At every training forward it walks the autograd
graph from the outputs to the operations that read such a weight (other than the lookup)
and hooks them: each hook takes that operation's gradient for the weight out of autograd's
sum (autograd then accumulates only the lookup's share into ``.grad``) and, once every
hooked operation produced its share, hands the sum to the weight's *early share*, a
parameter set of its own that goes on the wire at once. The lookup's share leaves from the
leaf's hook as any gradient does, with the lossless row-sparse codec
(:class:`~scaleout.compression.RowsCodec`). The averaged gradient is the sum of the two
averaged shares: exact up to float summation order. Whatever a hook misses (an operation
it did not find, a micro-batch under ``no_sync()``) stays in ``.grad`` and travels with the
lookup's share, so the sum stays exact in every case; only the overlap is lost.

:func:`~scaleout.pytorch.lookup_reads.find_lookup_reads` decides at the first forward which
weights are tied (the same on every rank: rank 0's graph decides; a first forward without
autograd, or one ``torch.compile`` fused into a single node, finds none, and the weight then
travels whole). A forward whose
graph is never backpropagated leaves a hook waiting: the early share of the next backward
then leaves at its end (still exact, without the overlap).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scaleout.pytorch.lookup_reads import (LOOKUP_DENSE_ABOVE, Node, exact_builtin,
                                           graph_readers, is_lookup)

__all__ = ["splittable", "EarlyShares", "LOOKUP_DENSE_ABOVE", "ENV_VAR"]

#: ``SCALEOUT_SPLIT_TIED=1`` turns the split on. It is off by default: on the 2-core machine
#: it was not shown to pay (its quietest before/after pair was slower, 1122 against 1006 ms
#: per iteration: the early share adds bytes on a link that is already busy for most of
#: backward; benchmarks/RESULTS.md, issue 16, stop 12).
ENV_VAR = "SCALEOUT_SPLIT_TIED"


def splittable(param: nn.Parameter, name: str, compression: Any, other_exchange: Any) -> bool:
    """Whether tied ``param`` (named ``name``) travels in two shares: only when it is sent
    exact (``compression`` has no codec for it) by the built-in all-reduce
    (``other_exchange`` falsy: no sharded update, no comm hook), and turned on
    (``SCALEOUT_SPLIT_TIED=1``)."""
    return os.environ.get(ENV_VAR, "0") == "1" and exact_builtin(param, name, compression,
                                                                 other_exchange)


@dataclass(eq=False)
class _Share:
    """One tied parameter's early share in this iteration."""

    param: nn.Parameter
    start: Callable[[torch.Tensor], None]
    expected: int = 0  # hooked operations whose share has not arrived yet
    gradient: torch.Tensor | None = None
    started: bool = False


class EarlyShares:
    """Takes tied parameters' non-lookup gradients out of autograd and sends them early.

    Args:
        starts: per tied parameter, what sends its early share (``start(gradient)``).
        holding_back: whether gradients stay local now (``no_sync()``): the hooks then leave
            the gradient to autograd.
        on_share: called with the parameter when a hook takes a share (DataParallel notes
            the parameter as used and arranges for the end of backward).
    """

    def __init__(self, starts: dict[nn.Parameter, Callable[[torch.Tensor], None]], *,
                 holding_back: Callable[[], bool],
                 on_share: Callable[[nn.Parameter], None]) -> None:
        self._shares = {id(p): _Share(param=p, start=start) for p, start in starts.items()}
        self._params = {id(p): p for p in starts}
        self._holding_back = holding_back
        self._on_share = on_share
        self._per_forward = 0  # readers found at the first hooked forward (stops the walk)

    def __bool__(self) -> bool:
        return bool(self._shares)

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (share.param for share in self._shares.values())

    def hook(self, outputs: Any) -> None:
        """Hook the operations of this forward's graph that read a tied parameter (other
        than its lookup); call after every forward whose graph backward will run."""
        if not self._shares:
            return
        want = self._per_forward

        def enough(found: dict[int, list[tuple[Node, int]]]) -> bool:
            return want > 0 and sum(not is_lookup(n) for nodes in found.values()
                                    for n, _ in nodes) >= want
        readers = graph_readers(outputs, self._params, enough)
        count = 0
        for key, nodes in readers.items():
            share = self._shares[key]
            for node, slot in nodes:
                if is_lookup(node):
                    continue
                node.register_hook(self._take(share, slot))
                share.expected += 1
                count += 1
        self._per_forward = max(self._per_forward, count)

    def _take(self, share: _Share, slot: int) -> Callable[..., Any]:
        def hook(grad_inputs: tuple[Any, ...], _grad_outputs: Any) -> Any:
            share.expected -= 1
            grad = grad_inputs[slot]
            if grad is None or self._holding_back() or share.started:
                return None  # autograd accumulates it into .grad (it travels with the rest)
            share.gradient = grad if share.gradient is None else share.gradient + grad
            self._on_share(share.param)
            if share.expected <= 0:
                self._start(share)
            return tuple(None if i == slot else g for i, g in enumerate(grad_inputs))
        return hook

    def _start(self, share: _Share) -> None:
        share.started = True
        gradient, share.gradient = share.gradient, None
        share.start(gradient)

    def end_backward(self) -> list[nn.Parameter]:
        """Send what was taken but not sent yet (an operation hooked but not run); forget
        this iteration. Returns the parameters whose early share was not sent at all."""
        unsent = []
        for share in self._shares.values():
            if share.gradient is not None and not share.started:
                self._start(share)
            if not share.started:
                unsent.append(share.param)
            share.started, share.expected = False, 0
        return unsent
