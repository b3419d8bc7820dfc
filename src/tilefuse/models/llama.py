"""A compact Llama in native PyTorch (gpt-fast style): one screen, no framework inside.

RMSNorm, grouped-query attention with rotary embeddings on adjacent pairs (the form that
becomes a pairwise epilogue) through `scaled_dot_product_attention`, a SwiGLU MLP, and
residual adds. `llama_block` and `llama` build one with PyTorch's default initialisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    ffn: int
    heads: int
    kv_heads: int | None = None  # None: as many as `heads`
    eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq: int = 4096
    vocab: int = 32000
    layers: int = 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def __post_init__(self):
        kv = self.kv_heads or self.heads
        if self.dim % self.heads or self.heads % kv or self.head_dim % 2:
            raise ValueError(f"dim {self.dim}, heads {self.heads}, kv_heads {kv}: dim must split into heads "
                             "of even size and heads into kv_heads groups")


def rope_tables(head_dim: int, max_seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i/head_dim), each (max_seq, head_dim // 2)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of the last dim by its position's angle."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads or cfg.heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:S], self.sin[:S]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:  # each kv head serves a group of query heads
            rep = self.heads // self.kv_heads
            k = k[:, :, None].expand(B, self.kv_heads, rep, S, self.head_dim).reshape(B, self.heads, S, self.head_dim)
            v = v[:, :, None].expand(B, self.kv_heads, rep, S, self.head_dim).reshape(B, self.heads, S, self.head_dim)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    """Token ids (B, S) -> logits (B, S, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama_block(dim: int, ffn: int, heads: int, kv_heads: int | None = None, *, eps: float = 1e-5,
                rope_theta: float = 10000.0, max_seq: int = 4096) -> Block:
    """One Llama decoder layer: (B, S, dim) -> (B, S, dim)."""
    return Block(LlamaConfig(dim, ffn, heads, kv_heads, eps, rope_theta, max_seq))


def llama(vocab: int, layers: int, dim: int, ffn: int, heads: int, kv_heads: int | None = None, *,
          eps: float = 1e-5, rope_theta: float = 10000.0, max_seq: int = 4096) -> Llama:
    """A whole Llama: embedding, `layers` blocks, final RMSNorm, LM head."""
    return Llama(LlamaConfig(dim, ffn, heads, kv_heads, eps, rope_theta, max_seq, vocab, layers))
