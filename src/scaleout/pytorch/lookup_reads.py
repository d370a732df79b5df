"""Which weights embedding lookups read, found in the first forward's autograd graph.

An embedding lookup's gradient (``F.embedding``, ``nn.Embedding``, ``nn.EmbeddingBag``;
dense, ``sparse=False``) is zero outside the rows the batch looked up. A weight read by
lookups *only* (DLRM's tables, an untied token embedding) can therefore travel row-sparse
and exact (:class:`~scaleout.compression.RowsCodec`: the union of the rows any rank
touched, nothing else). A weight read by a lookup *and* by other operations (an LM head
tied to its token embedding) is :mod:`scaleout.pytorch.tied`'s case.

:func:`find_lookup_reads` walks the graph of the first forward's outputs once and sorts the
parameters into the two kinds. Rank 0's graph decides (one all-gather of a flag per
parameter, which also checks that every rank wants row-sparse lookups or none), so every
rank registers the same parameter sets even if its first forward differed. A first forward without autograd, or one ``torch.compile`` fused into a single
node, finds neither kind, and every weight then travels whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import os
import warnings

import torch
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import Communicator

__all__ = ["LOOKUP_DENSE_ABOVE", "ROWS_ENV_VAR", "exact_builtin", "find_lookup_reads",
           "graph_readers", "is_lookup", "ran_embeddings", "rows_by_default", "rows_wanted"]

#: A lookup's gradient goes whole when more than this share of its rows was touched on some
#: rank. Each row flag costs one value of a row of ``d`` values, so rows pay almost up to
#: all rows (the transformer benchmark touches 56% of its 4096 rows per step).
LOOKUP_DENSE_ABOVE = 0.9

#: ``SCALEOUT_LOOKUP_ROWS=1`` sends weights read by lookups alone row-sparse, ``=0`` whole
#: (dense, as DDP does); unset: row-sparse where the gradients are on the CPU and the ranks
#: are not all on one machine (:func:`rows_by_default`).
ROWS_ENV_VAR = "SCALEOUT_LOOKUP_ROWS"

Node = Any  # an autograd graph node (torch._C._functions.*)
_OTHER, _LOOKUP_ONLY, _TIED = 0, 1, 2


def is_lookup(node: Node) -> bool:
    """An embedding lookup's backward (``F.embedding``, ``F.embedding_bag``, dense)."""
    return type(node).__name__.startswith("Embedding")


def _roots(outputs: Any) -> list[Node]:
    """The grad_fn of every tensor in ``outputs`` (a tensor, or nested tuples, lists, dicts)."""
    found: list[Node] = []
    stack = [outputs]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                found.append(obj.grad_fn)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list)):
            stack.extend(obj)
    return found


def graph_readers(outputs: Any, params: dict[int, nn.Parameter],
                  enough: Callable[[dict[int, list[tuple[Node, int]]]], bool] | None = None,
                  ) -> dict[int, list[tuple[Node, int]]]:
    """Per parameter id in ``params``: the graph nodes that read it, with the input slot.

    Breadth first from the outputs (an LM head sits next to them); stops early once
    ``enough(found so far)`` holds. Every node met stays referenced until the walk ends: a
    node's Python object can be made on access and freed after it (torch 2.11 on the
    device machine), and a freed object's ``id`` goes to the next one made, so a walk that
    kept ids alone took unvisited nodes for seen ones and missed DLRM's tables (RESULTS.md,
    stop 44).
    """
    found: dict[int, list[tuple[Node, int]]] = {}
    roots = _roots(outputs)
    queue, seen = deque(roots), {id(node): node for node in roots}  # id -> node, kept alive
    while queue:
        node = queue.popleft()
        for slot, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)  # an AccumulateGrad: a leaf
            if variable is not None and id(variable) in params:
                found.setdefault(id(variable), []).append((node, slot))
            elif id(nxt) not in seen:
                seen[id(nxt)] = nxt
                queue.append(nxt)
        if enough is not None and enough(found):
            break
    return found


def _kind(readers: list[tuple[Node, int]], rows: int) -> int:
    lookups = sum(is_lookup(node) for node, _ in readers)
    if not lookups:
        return _OTHER
    if lookups < len(readers):
        return _TIED
    share = _share_read(readers, rows)
    # a table whose rows one batch reads nearly all of (positions) would go whole anyway,
    # after a round of row flags: it stays dense
    return _OTHER if share is not None and share > LOOKUP_DENSE_ABOVE else _LOOKUP_ONLY


def _share_read(readers: list[tuple[Node, int]], rows: int) -> float | None:
    """The share of a table's ``rows`` that these lookups read (their saved indices), or
    ``None`` where a node does not show them."""
    try:
        ids = torch.cat([node._saved_indices.reshape(-1) for node, _ in readers])
    except (AttributeError, RuntimeError):
        return None
    return torch.unique(ids).numel() / max(rows, 1)


def ran_embeddings(layers: Iterable[Any]) -> dict[str, nn.Parameter]:
    """The trainable weights, by layer name, of the dense ``nn.Embedding`` and
    ``nn.EmbeddingBag`` modules among ``layers`` (:class:`~scaleout.pytorch.modules.Layer`:
    those the first forward ran)."""
    return {f"{layer.name}.weight" if layer.name else "weight": layer.module.weight
            for layer in layers
            if isinstance(layer.module, (nn.Embedding, nn.EmbeddingBag))
            and not layer.module.sparse and layer.module.weight.requires_grad}


def find_lookup_reads(outputs: Any, params: Iterable[nn.Parameter], comm: Communicator,
                      device: torch.device, *, rows: bool,
                      embeddings: dict[str, nn.Parameter] | None = None,
                      ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(tied, lookup_only)``: the parameters ``outputs``' graph reads by an embedding lookup
    and by something else, and those it reads by embedding lookups alone, less those whose
    rows this batch read more than ``LOOKUP_DENSE_ABOVE`` of (a positional embedding). Rank
    0's graph decides. ``rows``: whether this rank wants such weights row-sparse by default
    (:func:`rows_wanted`), checked alike on every rank; the caller applies it (a weight the
    user gave the ``rows`` codec goes row-sparse either way, and its lookups' ids serve it).
    ``embeddings``: the weights (by name) of the embedding modules this forward ran with
    autograd on; rank 0 warns, naming them, when the graph shows no read of some of them
    (they then travel whole: not row-sparse, not split).

    Raises:
        ValueError: on every rank, when the ranks' ``rows`` differ (``SCALEOUT_LOOKUP_ROWS``
            set differently): they would exchange those gradients differently.
    """
    params = list(params)
    readers = graph_readers(outputs, {id(p): p for p in params})
    unread = [name for name, p in (embeddings or {}).items() if not readers.get(id(p))]
    if unread and comm.rank == 0:
        more = f" and {len(unread) - 8} more" if len(unread) > 8 else ""
        warnings.warn(
            f"scaleout: the first forward's autograd graph shows no read of the embedding "
            f"weight(s) {', '.join(unread[:8])}{more}, although their modules ran: they travel "
            f"whole (not row-sparse, not split) with torch {torch.__version__}", RuntimeWarning,
            stacklevel=2)
    kinds = torch.tensor([*(_kind(readers.get(id(p), []), p.shape[0] if p.dim() else 1)
                            for p in params), int(rows)],
                         dtype=torch.int64, device=device)
    every = collectives.allgather(comm, kinds).wait() if comm.size > 1 else kinds
    every = every.view(comm.size, -1).tolist()
    wanted = [bool(per_rank[-1]) for per_rank in every]  # (each rank's last entry: rows)
    if len(set(wanted)) > 1:
        raise ValueError(
            f"rank {comm.rank}: row-sparse embedding gradients are on for ranks "
            f"{[r for r, on in enumerate(wanted) if on]} and off for the others; set "
            f"{ROWS_ENV_VAR} alike on every rank")
    decided = every[0][:-1]  # (rank 0's graph)
    return ([p for p, kind in zip(params, decided) if kind == _TIED],
            [p for p, kind in zip(params, decided) if kind == _LOOKUP_ONLY])


def exact_builtin(param: nn.Parameter, name: str, compression: Any, other_exchange: Any) -> bool:
    """Whether ``param`` (named ``name``) is sent exact (``compression`` has no codec for it)
    by the built-in all-reduce (``other_exchange`` falsy: no sharded update, no comm hook)."""
    return not other_exchange and (compression is None or compression.codec_for(
        name, param.numel(), param.dtype) is None)


def rows_by_default(device: torch.device, one_machine: bool) -> bool:
    """Whether lookups' gradients go row-sparse unless ``SCALEOUT_LOOKUP_ROWS`` says: on the
    CPU across machines. Row-sparse moves ~10x fewer bytes for DLRM's tables but costs the
    host a pass over the tables and a second round: measured on 2 cores, DLRM 2.4x DDP at 1
    Gbit/s and 9.2x at 100 Mbit/s, and at 10 Gbit/s as fast as the dense exchange (RESULTS.md,
    stop 33). With every rank on one machine
    (:attr:`~scaleout.launch.environment.LaunchInfo.one_machine`) the bytes are memory
    copies, so dense wins; on a GPU the rounds' host reads would stall the
    stream for bytes that NVLink or NCCL move faster."""
    return device.type == "cpu" and not one_machine


def rows_wanted(device: torch.device, one_machine: bool) -> bool:
    """``SCALEOUT_LOOKUP_ROWS`` (``1``: row-sparse, ``0``: dense), else
    :func:`rows_by_default`.

    Raises:
        ValueError: the variable holds something else.
    """
    setting = os.environ.get(ROWS_ENV_VAR, "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ROWS_ENV_VAR} must be 0 or 1, got {setting!r}")
    return setting == "1" if setting else rows_by_default(device, one_machine)
