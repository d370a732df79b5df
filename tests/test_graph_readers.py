"""The autograd graph walk that finds which nodes read each parameter
(:func:`scaleout.pytorch.lookup_reads.graph_readers`) reaches every node, also where a node's
Python object is made on access and freed after it; and an embedding it does not see is
named in a warning, not sent whole in silence.

torch 2.11 (the device machine's) does that: the walk used to keep only the ids of the nodes it
had met, a freed node's id went to the next node made, and the walk took unvisited nodes for
seen ones. DLRM's tables were missed and went dense at every rank count (RESULTS.md, stop 44).
The fakes below make each node's Python object the way torch does: one while it is alive, a
new one once it is gone.
"""

from __future__ import annotations

import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harness import run_ranks
from scaleout.pytorch import lookup_reads
from scaleout.pytorch.modules import find_layers


class _Node:
    """The C++ side of an autograd node: what it reads, and its Python object while alive."""

    def __init__(self, inputs: list) -> None:
        self.inputs = inputs  # _Node or a parameter (read through an AccumulateGrad)
        self.wrapper: weakref.ref | None = None


class _Accumulate:
    def __init__(self, variable: torch.Tensor) -> None:
        self.variable = variable


_FREED: list[_Wrapper] = []  # freed Python objects, whose ids the next ones made get


class _Wrapper:
    """A node's Python object: ``next_functions`` makes its inputs' objects on access. Once
    freed it serves as the next object made, as CPython's allocator can reuse its memory (and
    so its ``id``): here every time, so a walk that relies on ids of freed objects fails."""

    def __init__(self, node: _Node) -> None:
        self.node = node

    def __del__(self) -> None:
        _FREED.append(self)  # (kept: the next node's object is this one, retargeted)

    @property
    def next_functions(self) -> tuple:
        return tuple((_python_object(i) if isinstance(i, _Node) else _Accumulate(i), 0)
                     for i in self.node.inputs)


def _python_object(node: _Node) -> _Wrapper:
    live = node.wrapper() if node.wrapper is not None else None
    if live is None or live.node is not node:
        live = _FREED.pop() if _FREED else _Wrapper(node)
        live.node = node
        node.wrapper = weakref.ref(live)
    return live


@pytest.mark.parametrize("width", [1, 3])
def test_every_reader_is_found_when_node_objects_are_made_on_access(
        monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    # A chain 40 deep, each level of `width` nodes reading their own parameter and a node
    # that reads no parameter (an activation, say) in front of the next level.
    params = [torch.zeros(1, requires_grad=True) for _ in range(40 * width)]
    below: list = []
    for depth in reversed(range(40)):
        below = [_Node([_Node(below), params[depth * width + k]]) for k in range(width)]
    root = _Node(below)
    monkeypatch.setattr(lookup_reads, "_roots", lambda outputs: [_python_object(root)])
    found = lookup_reads.graph_readers(None, {id(p): p for p in params})
    _FREED.clear()
    assert len(found) == len(params)
    assert all(len(readers) == 1 for readers in found.values())


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.sparse = nn.Embedding(10, 4, sparse=True)  # (its gradient is sparse already)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids) + self.sparse(ids)).sum()


def test_embedding_weights_the_walk_does_not_see_are_named_in_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Tables()
    ran = lookup_reads.ran_embeddings(find_layers(model))
    assert list(ran) == ["emb.weight"]
    alone = SimpleNamespace(size=1, rank=0)
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the walk sees the table: nothing to say
        _, only = lookup_reads.find_lookup_reads(model(torch.tensor([1, 2])), params, alone,
                                                 torch.device("cpu"), rows=True, embeddings=ran)
    assert any(p is model.emb.weight for p in only)
    monkeypatch.setattr(lookup_reads, "graph_readers", lambda outputs, params: {})
    with pytest.warns(RuntimeWarning, match=r"no read of the embedding weight\(s\) emb.weight, "
                                            r"although their modules ran: they travel whole"):
        _, only = lookup_reads.find_lookup_reads(model(torch.tensor([1, 2])), params, alone,
                                                 torch.device("cpu"), rows=True, embeddings=ran)
    assert only == []


def _walk_body(device: str) -> tuple[int, int]:
    model = _Tables().to(device)
    params = {id(p): p for p in model.parameters()}
    found = lookup_reads.graph_readers(model(torch.tensor([1, 2], device=device)), params)
    return len(found), len(params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_walk_reads_every_parameter_of_a_real_graph(device: str) -> None:
    """On this torch's own nodes (the device machine's torch for ``cuda``): the tables, the
    sparse one too, and the linear layer."""
    ((found, total),) = run_ranks(1, _walk_body, device, timeout=120)
    assert found == total == 4
