"""Tensor-parallel layers on the MODEL group of a Distribution (Megatron-LM's pairing).

``ColumnParallelLinear`` splits the output features (its weight's rows) across the model
group; ``RowParallelLinear`` splits the input features (its weight's columns). A column layer
followed by a row layer (an MLP block, or attention's q/k/v then output projection) costs one
allreduce forward (after the row layer) and one backward (before the column layer).
``VocabParallelEmbedding`` splits the rows of a table; each rank looks up the ids it holds
and one allreduce assembles the result.

A layer built by its constructor holds its part of the unsplit layer's initial weights
(``nn.Linear``'s or ``nn.Embedding``'s init, drawn whole from the default generator, which
the ranks of a model group share): ``ColumnParallelLinear(8, 6, ...)`` after
``torch.manual_seed(s)`` is this rank's block of ``nn.Linear(8, 6)`` after the same seed.

Every sharded parameter is marked (``scaleout.pytorch.placement``) so that DataParallel
registers it with its local size and ``full_state_dict`` can gather it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.core.collectives import Communicator
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.pytorch.exchange_stats import ExchangeRecorder
from scaleout.pytorch.modules import broadcast_tensors
from scaleout.pytorch.placement import Kind, Placement, place, placement_of
from scaleout.pytorch.tensor_parallel.agreement import check_replicated
from scaleout.pytorch.tensor_parallel.exchanges import (
    copy_to_model,
    gather_from_model,
    reduce_from_model,
    scatter_to_model,
)

__all__ = ["ModelParallelLayer", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding"]


def _split(size: int, parts: int, what: str, layer: str, kind: str,
           by: str = "the model group size") -> int:
    if size % parts:
        raise ValueError(f"{kind} {layer or '(unnamed)'}: {what} = {size} must be divisible by "
                         f"{by} {parts}")
    return size // parts


class ModelParallelLayer(nn.Module):
    """What the tensor-parallel layers share: their model group and their name.

    Args:
        distribution: the grid; the layer is split across its MODEL group.
        name: the layer's name in errors (``tensor_parallel`` passes its qualified name).

    Raises:
        TypeError: ``distribution`` is not a scaleout Distribution.
    """

    def __init__(self, distribution: Distribution, name: str) -> None:
        super().__init__()
        if not isinstance(distribution, Distribution):
            raise TypeError(f"{type(self).__name__} {name}: distribution must be a "
                            f"scaleout.Distribution, got {type(distribution).__name__}")
        self.comm: Communicator = distribution.communicator(GroupType.MODEL)
        self.layer_name = name
        self.exchange_recorder = ExchangeRecorder(name)
        self.parts = self.comm.size
        self.part = self.comm.rank

    def _shard(self, full: torch.Tensor, dim: int, blocks: int = 1) -> nn.Parameter:
        """This rank's part of ``full`` (the unsplit layer's tensor, drawn alike on every rank
        of the group), as a marked parameter."""
        mark = Placement(kind=Kind.SHARDED, layer=self.layer_name, comm=self.comm, dim=dim,
                         blocks=blocks)
        return place(nn.Parameter(mark.part_of(full.detach(), self.part).clone()), mark)

    def _check_replicated(self, tensor: torch.Tensor, what: str) -> None:
        """A ValueError unless ``tensor`` is equal on every rank of the model group (on the
        consistency check's schedule: ``tensor_parallel/agreement.py``)."""
        name = f"{type(self).__name__} {self.layer_name or '(unnamed)'}"
        check_replicated(tensor, self.comm, name, what, id(self))


class ColumnParallelLinear(ModelParallelLayer):
    """``y = x W^T + b`` with ``W``'s rows (output features) split across the model group.

    Args:
        in_features / out_features: the full layer's sizes; ``out_features`` must divide by
            the model group size.
        distribution: the grid.
        bias: learn a bias (split like the output).
        gather_output: allgather the output blocks (the full ``out_features`` on every rank);
            otherwise each rank returns its ``out_features / parts`` block, ready for a
            :class:`RowParallelLinear`.
        blocks: the outputs are this many equal blocks (a fused ``[q; k; v]`` projection:
            3), each split across the model group: a rank computes its slice of each, in
            order (``[q_r; k_r; v_r]``: its output splits in three like the whole one's).
        dtype: parameter dtype. name: for errors.

    Raises:
        ValueError: ``out_features`` (a block of it) does not divide by the model group size,
            or ``blocks`` is not an int >= 1 dividing it.

    Example (model group of 2: rank 0 holds outputs 0..3, rank 1 outputs 4..7):
        >>> layer = ColumnParallelLinear(16, 8, distribution=dist)
        >>> layer(torch.randn(5, 16)).shape
        torch.Size([5, 4])
    """

    def __init__(self, in_features: int, out_features: int, *, distribution: Distribution,
                 bias: bool = True, gather_output: bool = False, blocks: int = 1,
                 dtype: torch.dtype | None = None, name: str = "") -> None:
        super().__init__(distribution, name)
        self.in_features, self.out_features = in_features, out_features
        kind = type(self).__name__
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"{kind} {name or '(unnamed)'}: blocks must be an int >= 1, got "
                             f"{blocks!r}")
        block = _split(out_features, blocks, "out_features", name, kind, "the number of blocks")
        what = "out_features" if blocks == 1 else f"a block of out_features ({blocks} blocks)"
        self.blocks = blocks
        self.local_out = _split(block, self.parts, what, name, kind) * blocks
        self.gather_output = gather_output
        full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)  # its init
        self.weight = self._shard(full.weight, 0, blocks)
        self.bias = self._shard(full.bias, 0, blocks) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, distribution: Distribution, name: str = "",
                    gather_output: bool = False, blocks: int = 1) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (its initial weights kept); ``blocks``: as for the
        constructor (3 for a fused ``[q; k; v]`` projection)."""
        layer = cls(linear.in_features, linear.out_features, distribution=distribution,
                    bias=linear.bias is not None, gather_output=gather_output, blocks=blocks,
                    dtype=linear.weight.dtype, name=name)
        with torch.no_grad():
            for mine, full in ((layer.weight, linear.weight), (layer.bias, linear.bias)):
                if full is not None:
                    mine.copy_(placement_of(mine).part_of(full, layer.part))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rec = self.exchange_recorder
        self._check_replicated(x, "input")
        out = F.linear(copy_to_model(x, self.comm, rec), self.weight, self.bias)
        if not self.gather_output:
            return out
        out = gather_from_model(out, self.comm, rec)  # the ranks' parts, in rank order
        if self.blocks > 1:  # [q_0; k_0; v_0; q_1; ...] -> [q; k; v]
            out = placement_of(self.weight).joined(out.movedim(-1, 0)).movedim(0, -1)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.local_out} here, part {self.part}/{self.parts}), "
                f"gather_output={self.gather_output}"
                + (f", blocks={self.blocks}" if self.blocks > 1 else ""))


class RowParallelLinear(ModelParallelLayer):
    """``y = x W^T + b`` with ``W``'s columns (input features) split across the model group.

    Args:
        in_features / out_features: the full layer's sizes; ``in_features`` must divide by
            the model group size.
        distribution: the grid.
        bias: learn a bias (replicated: added once, after the allreduce).
        input_is_parallel: the input is already this rank's block of the features (the
            output of a :class:`ColumnParallelLinear`); otherwise the layer takes its block.
        dtype: parameter dtype. name: for errors.

    Raises:
        ValueError: ``in_features`` does not divide by the model group size.
    """

    def __init__(self, in_features: int, out_features: int, *, distribution: Distribution,
                 bias: bool = True, input_is_parallel: bool = True,
                 dtype: torch.dtype | None = None, name: str = "") -> None:
        super().__init__(distribution, name)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _split(in_features, self.parts, "in_features", name, type(self).__name__)
        self.input_is_parallel = input_is_parallel
        full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)  # its init
        self.weight = self._shard(full.weight, 1)
        self.bias = full.bias
        if self.bias is not None:  # replicated: the same on every rank of the model group
            broadcast_tensors(self.comm, [self.bias])

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, distribution: Distribution, name: str = "",
                    input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's shard of ``linear`` (its initial weights kept)."""
        layer = cls(linear.in_features, linear.out_features, distribution=distribution,
                    bias=linear.bias is not None, input_is_parallel=input_is_parallel,
                    dtype=linear.weight.dtype, name=name)
        cols = slice(layer.part * layer.local_in, (layer.part + 1) * layer.local_in)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            self._check_replicated(x, "input")
            x = scatter_to_model(x, self.comm, self.exchange_recorder)
        elif x.shape[-1] != self.local_in:
            raise ValueError(f"RowParallelLinear {self.layer_name}: expected this rank's block of "
                             f"{self.local_in} input features (of {self.in_features}), got "
                             f"{x.shape[-1]}")
        out = reduce_from_model(F.linear(x, self.weight), self.comm, self.exchange_recorder)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.local_in} here, part "
                f"{self.part}/{self.parts}), out_features={self.out_features}")


class VocabParallelEmbedding(ModelParallelLayer):
    """An embedding table whose rows (the vocabulary) are split across the model group.

    Each rank looks up the ids in its row range (zeros elsewhere); one allreduce forward
    sums the blocks, and the gradient (replicated) reaches only the rows a rank holds.

    Args:
        num_embeddings / embedding_dim: the full table's shape; ``num_embeddings`` must
            divide by the model group size.
        distribution: the grid. dtype: parameter dtype. name: for errors.

    Raises:
        ValueError: ``num_embeddings`` does not divide by the model group size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, distribution: Distribution,
                 dtype: torch.dtype | None = None, name: str = "") -> None:
        super().__init__(distribution, name)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_rows = _split(num_embeddings, self.parts, "num_embeddings", name,
                                 type(self).__name__)
        self.start = self.part * self.local_rows
        full = torch.empty(num_embeddings, embedding_dim, dtype=dtype).normal_()  # nn.Embedding's
        self.weight = self._shard(full, 0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, distribution: Distribution,
                       name: str = "") -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (its initial weights kept)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None \
                or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError(f"VocabParallelEmbedding {name}: padding_idx, max_norm, sparse and "
                             "scale_grad_by_freq embeddings are not supported")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim,
                    distribution=distribution, dtype=embedding.weight.dtype, name=name)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.start: layer.start + layer.local_rows])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(*)`` ids -> ``(*, embedding_dim)``, the same ids on every rank of the model group.

        Raises:
            ValueError: an id outside ``[0, num_embeddings)`` (it would read zeros: no rank
                holds it); every rank of the group sees the same ids, so every rank raises.
                On a GPU it is a device-side assert instead (as ``nn.Embedding``'s), so the
                check never makes the host wait for the device.
        """
        wrong = (ids < 0) | (ids >= self.num_embeddings)
        if ids.device.type != "cpu":
            torch._assert_async(~wrong.any(), f"VocabParallelEmbedding {self.layer_name}: ids "
                                f"must be in [0, {self.num_embeddings})")
        elif bool(wrong.any()):
            raise ValueError(f"VocabParallelEmbedding {self.layer_name}: ids must be in [0, "
                             f"{self.num_embeddings}), got {ids[wrong][0].item()}")
        self._check_replicated(ids, "ids")
        outside = (ids < self.start) | (ids >= self.start + self.local_rows)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_model(out, self.comm, self.exchange_recorder)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}.."
                f"{self.start + self.local_rows - 1} here)")
