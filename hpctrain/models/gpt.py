"""Tiny GPT-style decoder with tied embeddings, and its Markov-chain factory."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import make_markov_tokens

__all__ = ["GPT", "GPTBlock", "CausalSelfAttention", "factory", "lm_loss", "DEFAULTS"]

DEFAULTS = dict(vocab=67, d_model=48, heads=4, layers=2, seq_len=32, n_samples=2048)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on scaled_dot_product_attention."""

    def __init__(self, d_model, heads):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model, heads, mlp_ratio=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, GPTBlocks, final LayerNorm, tied output head."""

    def __init__(self, vocab=67, d_model=48, heads=4, layers=2, seq_len=32):
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one Parameter, two uses
        self._init_weights(layers)

    def _init_weights(self, layers):
        # GPT-2 style: small normal init; residual projections scaled down by depth.
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if not name.endswith("weight"):  # biases (LayerNorm weights keep 1)
                    nn.init.zeros_(p)
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def factory(seed=0, *, vocab=67, d_model=48, heads=4, layers=2, seq_len=32, n_samples=2048,
            branching=3):
    """Return (GPT, Markov-chain token data set, lm_loss)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(vocab, d_model, heads, layers, seq_len)
    data = make_markov_tokens(n_samples, seq_len, vocab, seed, branching)
    return model, data, lm_loss
