"""Small plain models for the model-parallel tests (built identically by the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> nn.Module:
    """Two column/row pairs: 8 -> 12 -> 6 -> 12 -> 4."""
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6), nn.Tanh(),
                         nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4))


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v and output projections."""

    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (f(x).view(batch, seq, self.n_heads, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(batch, seq, -1))


class LlamaAttention(nn.Module):
    """LLaMA's names (wq/wk/wv/wo) and grouped k/v heads: ``n_kv_heads`` of them, each shared
    by ``n_heads / n_kv_heads`` query heads."""

    def __init__(self, width: int = 8, n_heads: int = 4, n_kv_heads: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        kv_width = width // n_heads * n_kv_heads
        self.wq, self.wo = nn.Linear(width, width), nn.Linear(width, width)
        self.wk, self.wv = nn.Linear(width, kv_width), nn.Linear(width, kv_width)

    def head_counts(self) -> tuple[int, int]:
        """(query heads, k/v heads) the forward reshapes with."""
        return self.n_heads, self.n_kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads, kv_heads = self.head_counts()
        q = self.wq(x).view(batch, seq, heads, -1).transpose(1, 2)
        k, v = (f(x).view(batch, seq, kv_heads, -1).transpose(1, 2)
                .repeat_interleave(heads // kv_heads, dim=1) for f in (self.wk, self.wv))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.wo((att @ v).transpose(1, 2).reshape(batch, seq, -1))


class LocalHeadsAttention(LlamaAttention):
    """LLaMA's reference code: the forward reshapes with the heads *this rank* holds
    (``n_local_heads``, ``n_local_kv_heads``); built unsplit, they are all the heads."""

    def __init__(self, width: int = 8, n_heads: int = 4, n_kv_heads: int = 2) -> None:
        super().__init__(width, n_heads, n_kv_heads)
        self.n_local_heads, self.n_local_kv_heads = n_heads, n_kv_heads
        del self.n_heads, self.n_kv_heads

    def head_counts(self) -> tuple[int, int]:
        return self.n_local_heads, self.n_local_kv_heads


class FusedAttention(nn.Module):
    """GPT-2's layout: one ``[q; k; v]`` projection whose output the forward splits in three."""

    def __init__(self, width: int = 12, n_heads: int = 2) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (z.view(batch, seq, self.n_heads, -1).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Token embedding, a pre-LN transformer block (attention, then an MLP), a replicated head."""

    def __init__(self, width: int = 12, n_heads: int = 6, vocab: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, n_heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))
        self.head = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


MODELS = {"mlp": mlp, "block": Block}


def batch(kind: str, step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets of one global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return (torch.randn(samples, 8, generator=g, dtype=torch.float64),
                torch.randn(samples, 4, generator=g, dtype=torch.float64))
    return (torch.randint(0, 12, (samples, 5), generator=g),
            torch.randn(samples, 5, 3, generator=g, dtype=torch.float64))
