"""A GPT-style language model on a learnable synthetic token distribution.

Model: token + learned position embeddings, ``n_layers`` pre-LayerNorm blocks
(causal multi-head self-attention, then a GELU MLP), a final LayerNorm and an
LM head tied to the token embedding (GPT-2 layout, with biases, without
dropout). It maps ``(B, T)`` token ids to ``(B, T, vocab_size)`` logits.

Data: sequences from a fixed sparse Markov chain. Every token has
``branching`` possible successors with Zipf-like probabilities, so the loss
falls from ``ln(vocab_size)`` towards the chain's entropy (about 1.2 nats for
the default ``branching=4``). Targets are the inputs shifted by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from scaleout.workloads.base import Batch, Workload, build_seeded, check_int, make_generator

__all__ = ["GPT", "TransformerConfig", "TransformerWorkload"]

_CHAIN_SALT = 0x6A7


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Shape of the GPT model.

    Args:
        vocab_size: number of token ids, >= 2.
        seq_len: context length (tokens per sample), >= 1.
        d_model: embedding width; a multiple of ``n_heads``.
        n_layers: number of transformer blocks, >= 1.
        n_heads: attention heads per block, >= 1.
        mlp_ratio: MLP hidden width as a multiple of ``d_model``, >= 1.

    Raises:
        TypeError: if a field is not an int.
        ValueError: if a field is out of range or ``d_model % n_heads != 0``.
    """

    vocab_size: int = 4096
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        minimums = {"vocab_size": 2, "seq_len": 1, "d_model": 1, "n_layers": 1,
                    "n_heads": 1, "mlp_ratio": 1}
        for name, minimum in minimums.items():
            check_int(f"TransformerConfig.{name}", getattr(self, name), minimum)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position ``t`` sees positions ``<= t``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (three equal parts and the head count: under tensor_parallel's "qkv" plan the
        # projection gives each rank its [q_r; k_r; v_r] and n_heads is this rank's heads)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-style causal LM: ``(B, T)`` int64 ids -> ``(B, T, vocab_size)`` logits.

    The output projection reuses ``tok_emb.weight`` (tied), so it owns no
    parameters of its own.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.proj.weight, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence length {seq} exceeds seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


@dataclass(frozen=True, kw_only=True)
class TransformerWorkload(Workload):
    """GPT language modelling on a synthetic sparse Markov chain.

    Args:
        config: model shape (also fixes vocabulary and sequence length).
        default_batch_size: per-rank batch size (sequences) used by benchmarks.
        branching: number of possible successors of each token, >= 1.

    Raises:
        TypeError, ValueError: on construction, for invalid fields.
    """

    config: TransformerConfig = field(default_factory=TransformerConfig)
    default_batch_size: int = 16
    branching: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(self.config).__name__}")
        check_int("default_batch_size", self.default_batch_size, 1)
        check_int("branching", self.branching, 1)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "transformer"

    @property
    def description(self) -> str:  # type: ignore[override]
        c = self.config
        return (
            f"GPT LM ({c.n_layers} layers, d={c.d_model}, {c.n_heads} heads, vocab "
            f"{c.vocab_size}, seq {c.seq_len}) on a synthetic Markov chain, "
            f"batch {self.default_batch_size}/rank"
        )

    def build_model(self, seed: int) -> GPT:
        return build_seeded(lambda: GPT(self.config), seed)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())

    def chain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed Markov chain: ``(successors (V, k) int64, probabilities (k,))``.

        It depends only on the vocabulary size and ``branching``, not on seeds.
        """
        vocab, k = self.config.vocab_size, self.branching
        generator = make_generator(_CHAIN_SALT, vocab, k)
        successors = torch.randint(vocab, (vocab, k), generator=generator)
        weights = 1.0 / torch.arange(1, k + 1, dtype=torch.float64)
        return successors, (weights / weights.sum()).float()

    def entropy(self) -> float:
        """Per-token entropy of the chain in nats: the best achievable mean loss."""
        _, probs = self.chain()
        return float(-(probs * probs.log()).sum())

    def _global_batch(self, batch_size: int, step: int, seed: int) -> Batch:
        successors, probs = self.chain()
        seq = self.config.seq_len
        generator = make_generator(seed, step)
        tokens = torch.empty(batch_size, seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.config.vocab_size, (batch_size,), generator=generator)
        choices = torch.multinomial(
            probs, batch_size * seq, replacement=True, generator=generator
        ).view(batch_size, seq)
        for t in range(seq):
            tokens[:, t + 1] = successors[tokens[:, t], choices[:, t]]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
