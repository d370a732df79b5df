"""DLRM (Naumov et al., 2019) on synthetic Criteo-like click data.

Model: dense features -> bottom MLP -> a vector of width ``embedding_dim``; one
embedding table per categorical feature (``nn.Embedding`` with dense
gradients, so plain data-parallel allreduce applies); pairwise dot products of
all these vectors (the strictly lower triangle), concatenated with the
bottom-MLP output; top MLP -> one logit per sample; BCE-with-logits loss.

Data: 13 dense features (``log1p`` of exponential counts, as Criteo's are
usually preprocessed) and one id per table drawn from a truncated Zipf law,
``P(id = i) ~ (i + 1) ** -zipf_exponent``: id 0 is the most frequent, and a few
ids carry most of the mass. Labels are Bernoulli draws from a hidden logistic
rule (a linear term in the dense features plus a fixed random weight per id),
so the task is learnable but not noiseless.

The default config has 26 tables of 3 to 20,000 rows (78k rows x 16 = 1.2M
embedding parameters, ~5 MB of gradients), so communication is significant
while an iteration takes a few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.workloads.base import Batch, Workload, build_seeded, check_int, make_generator

__all__ = ["DLRM", "DLRMConfig", "DLRMInputs", "DLRMWorkload", "LARGE_TABLE_SIZES", "zipf_cdf"]

_RULE_SALT = 0xD12
_CRITEO_LIKE_SIZES = (20000, 10000, 5000, 2000, 1000, 500, 200, 100, 50, 20, 10, 5, 3) * 2
#: ``dlrm-large``: ten times the rows (12.5M embedding parameters, about 200x the dense ones).
LARGE_TABLE_SIZES = tuple(10 * rows for rows in _CRITEO_LIKE_SIZES)


def _check_int_tuple(name: str, values: tuple[int, ...], minimum: int) -> None:
    if not isinstance(values, tuple):
        raise TypeError(f"{name} must be a tuple of ints, got {type(values).__name__}")
    for i, value in enumerate(values):
        check_int(f"{name}[{i}]", value, minimum)


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """Shape of the DLRM model and of its synthetic data.

    Args:
        num_dense: number of dense features, >= 1 (Criteo: 13).
        table_sizes: rows of each embedding table, one table per categorical
            feature (Criteo: 26 features).
        embedding_dim: width of every embedding and of the bottom-MLP output.
        bottom_mlp: hidden widths of the bottom MLP (its output is ``embedding_dim``).
        top_mlp: hidden widths of the top MLP (its output is one logit).
        zipf_exponent: exponent of the id distribution, > 0.

    Raises:
        TypeError: if a field has the wrong type.
        ValueError: if a field is out of range.
    """

    num_dense: int = 13
    table_sizes: tuple[int, ...] = _CRITEO_LIKE_SIZES
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (128, 64)
    zipf_exponent: float = 1.05

    def __post_init__(self) -> None:
        check_int("DLRMConfig.num_dense", self.num_dense, 1)
        check_int("DLRMConfig.embedding_dim", self.embedding_dim, 1)
        _check_int_tuple("DLRMConfig.table_sizes", self.table_sizes, 1)
        _check_int_tuple("DLRMConfig.bottom_mlp", self.bottom_mlp, 1)
        _check_int_tuple("DLRMConfig.top_mlp", self.top_mlp, 1)
        if not self.table_sizes:
            raise ValueError("DLRMConfig.table_sizes must name at least one table")
        if isinstance(self.zipf_exponent, bool) or not isinstance(self.zipf_exponent, (int, float)):
            raise TypeError(f"DLRMConfig.zipf_exponent must be a number, got {self.zipf_exponent!r}")
        if self.zipf_exponent <= 0:
            raise ValueError(f"DLRMConfig.zipf_exponent must be > 0, got {self.zipf_exponent}")

    @property
    def num_sparse(self) -> int:
        """Number of categorical features (= embedding tables)."""
        return len(self.table_sizes)


class DLRMInputs(NamedTuple):
    """One DLRM batch of inputs; ``model(DLRMInputs(dense, sparse))``."""

    dense: torch.Tensor
    """``(B, num_dense)`` float32 dense features."""
    sparse: torch.Tensor
    """``(B, num_sparse)`` int64 ids; column ``t`` indexes table ``t``."""


def _mlp(widths: list[int], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if final_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Deep Learning Recommendation Model: :class:`DLRMInputs` -> ``(B,)`` logits."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        dim = config.embedding_dim
        self.bottom_mlp = _mlp([config.num_dense, *config.bottom_mlp, dim], final_relu=True)
        self.embeddings = nn.ModuleList(
            nn.Embedding(rows, dim, sparse=False) for rows in config.table_sizes
        )
        for table in self.embeddings:
            nn.init.uniform_(table.weight, -(table.num_embeddings ** -0.5), table.num_embeddings ** -0.5)
        n_vectors = config.num_sparse + 1
        rows, cols = torch.tril_indices(n_vectors, n_vectors, offset=-1)
        # the pairs as positions in a flattened (F, F) block: index_select's backward is an
        # index_add, about half the time of 2-D advanced indexing's (an index_put with a sort)
        self.register_buffer("_pairs", rows * n_vectors + cols, persistent=False)
        n_pairs = n_vectors * (n_vectors - 1) // 2
        self.top_mlp = _mlp([dim + n_pairs, *config.top_mlp, 1], final_relu=False)

    def forward(self, inputs: DLRMInputs) -> torch.Tensor:
        dense, sparse = inputs
        x = self.bottom_mlp(dense)
        if isinstance(self.embeddings, nn.ModuleList):
            vectors = [x] + [table(sparse[:, t]) for t, table in enumerate(self.embeddings)]
            stacked = torch.stack(vectors, dim=1)  # (B, F, D)
        else:  # sharded (scaleout.pytorch.EmbeddingCollection): (B, F - 1, D) for my samples
            stacked = torch.cat([x.unsqueeze(1), self.embeddings(sparse)], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # (B, F, F)
        pairs = dots.flatten(1).index_select(1, self._pairs)  # the strict lower triangle
        return self.top_mlp(torch.cat([x, pairs], dim=1)).squeeze(1)


def zipf_cdf(rows: int, exponent: float) -> torch.Tensor:
    """Cumulative distribution of ``P(i) ~ (i + 1) ** -exponent`` over ``0..rows-1`` (float64)."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    cdf = weights.cumsum(0)
    return cdf / cdf[-1]


@dataclass(frozen=True, kw_only=True)
class DLRMWorkload(Workload):
    """DLRM click-through prediction on synthetic Zipf-distributed Criteo-like data.

    Args:
        config: model and data shape.
        default_batch_size: per-rank batch size used by benchmarks.
        variant: appended to the name (``"large"``: ``dlrm-large``).

    Raises:
        TypeError, ValueError: on construction, for invalid fields.
    """

    config: DLRMConfig = field(default_factory=DLRMConfig)
    default_batch_size: int = 256
    variant: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.config, DLRMConfig):
            raise TypeError(f"config must be a DLRMConfig, got {type(self.config).__name__}")
        check_int("DLRMWorkload.default_batch_size", self.default_batch_size, 1)
        if not isinstance(self.variant, str):
            raise TypeError(f"variant must be a str, got {type(self.variant).__name__}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"dlrm-{self.variant}" if self.variant else "dlrm"

    @property
    def description(self) -> str:  # type: ignore[override]
        c = self.config
        return (
            f"DLRM, {c.num_dense} dense + {c.num_sparse} categorical features "
            f"({sum(c.table_sizes)} embedding rows x {c.embedding_dim}), synthetic Zipf "
            f"click data, batch {self.default_batch_size}/rank"
        )

    def build_model(self, seed: int) -> DLRM:
        return build_seeded(lambda: DLRM(self.config), seed)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs, targets)

    @cached_property
    def _data_tables(self) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """Per-table Zipf CDFs and the hidden rule (dense weights, per-id weights).

        They depend only on the config, are computed once per workload object
        and never handed out.
        """
        c = self.config
        cdfs = [zipf_cdf(rows, c.zipf_exponent) for rows in c.table_sizes]
        generator = make_generator(_RULE_SALT, c.num_dense, c.num_sparse)
        dense_weights = torch.randn(c.num_dense, generator=generator) / c.num_dense ** 0.5
        id_weights = [torch.randn(rows, generator=generator) / c.num_sparse ** 0.5
                      for rows in c.table_sizes]
        return cdfs, dense_weights, id_weights

    def _global_batch(self, batch_size: int, step: int, seed: int) -> Batch:
        c = self.config
        cdfs, dense_weights, id_weights = self._data_tables
        generator = make_generator(seed, step)
        counts = -torch.log1p(-torch.rand(batch_size, c.num_dense, generator=generator))  # Exp(1)
        dense = torch.log1p(4.0 * counts)
        uniforms = torch.rand(c.num_sparse, batch_size, generator=generator, dtype=torch.float64)
        columns = [torch.searchsorted(cdf, u).clamp_(max=len(cdf) - 1) for cdf, u in zip(cdfs, uniforms)]
        sparse = torch.stack(columns, dim=1)
        logit = (dense - 1.0) @ dense_weights
        for column, weights in zip(columns, id_weights):
            logit += weights[column]
        targets = torch.bernoulli(torch.sigmoid(2.0 * logit - 1.0), generator=generator)
        return DLRMInputs(dense, sparse), targets
