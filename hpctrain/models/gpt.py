"""Tiny GPT-style decoder with tied embeddings, and its Markov-chain factory."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import make_markov_tokens
from .dropout import Dropout
from .layers import LayerStack, PipeLayer, seeded

__all__ = ["GPT", "GPTBlock", "CausalSelfAttention", "factory", "gpt_layers", "lm_loss",
           "pipeline", "tp_plan", "DEFAULTS"]

DEFAULTS = dict(vocab=67, d_model=48, heads=4, layers=2, seq_len=32, n_samples=2048, dropout=0.0)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on scaled_dot_product_attention.

    The head count it runs is read from the qkv output (whole heads of ``head_dim``), so
    the same module runs the heads a tensor-parallel rank holds. With attention dropout in
    training the probabilities are formed explicitly, so the mask is ``Dropout``'s (the same
    for any split of the heads) rather than the fused kernel's."""

    def __init__(self, d_model, heads, dropout=0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = Dropout(dropout)

    def forward(self, x):
        h = self.qkv(x)  # under sequence parallel x is a sequence chunk, h the whole sequence
        b, t = h.shape[0], h.shape[1]
        width = h.shape[-1] // 3
        q, k, v = (z.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)
                   for z in h.split(width, dim=2))
        if self.training and self.drop.p > 0:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
            att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class GPTBlock(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln(x))), then x + drop(mlp(ln(x)))."""

    def __init__(self, d_model, heads, mlp_ratio=4, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.drop1 = Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))
        self.drop2 = Dropout(dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


def tp_plan(heads: int) -> dict:
    """The GPT's tensor-parallel plan (module-name patterns -> styles; parallel/tensor):
    Megatron's layout. Attention heads and the MLP's hidden units are split (qkv and the
    first MLP layer column-wise, the projections row-wise), the vocabulary is split in the
    tied embedding/head, and the LayerNorms, position embedding and residual dropouts run
    on sequence chunks when sequence parallel is on."""
    seq = "sequence_parallel"
    return {"tok_emb": "vocab_embedding", "pos_emb": seq,
            "blocks.*.ln1": seq, "blocks.*.ln2": seq, "ln_f": seq,
            "blocks.*.drop1": seq, "blocks.*.drop2": seq,
            "blocks.*.attn.qkv": {"style": "colwise", "parts": 3, "heads": heads},
            "blocks.*.attn.drop": "attention_dropout",
            "blocks.*.attn.proj": "rowwise",
            "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
            "head": "vocab_head"}


class GPT(nn.Module):
    """Token + learned position embeddings, GPTBlocks, final LayerNorm, tied output head.

    Built from ``gpt_layers``: each layer is initialised under its own seed, so a pipeline
    stage that builds only some layers gets exactly these weights.
    """

    def __init__(self, vocab=67, d_model=48, heads=4, layers=2, seq_len=32, seed=0,
                 dropout=0.0):
        super().__init__()
        self.seq_len = seq_len
        self.tp_plan = tp_plan(heads)
        built = {}
        for layer in gpt_layers(vocab, d_model, heads, layers, seq_len, seed, dropout).layers:
            built.update(layer.build())
        self.tok_emb = built["tok_emb"]
        self.pos_emb = built["pos_emb"]
        self.blocks = nn.ModuleList(built[f"blocks.{i}"] for i in range(layers))
        self.ln_f = built["ln_f"]
        self.head = built["head"]
        self.head.weight = self.tok_emb.weight  # tied: one Parameter, two uses

    def forward(self, idx):
        x = _embed(self, idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_(module, prefix, layers):
    # GPT-2 style: small normal init; residual projections scaled down by depth.
    for name, p in module.named_parameters(prefix=prefix):
        if p.dim() == 1:
            if not name.endswith("weight"):  # biases (LayerNorm weights keep 1)
                nn.init.zeros_(p)
        elif name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
        else:
            nn.init.normal_(p, std=0.02)


def _embed(root, idx):
    t = idx.shape[1]
    if t > root.pos_emb.num_embeddings:
        raise ValueError(f"sequence length {t} exceeds the model's seq_len "
                         f"{root.pos_emb.num_embeddings}")
    return root.tok_emb(idx) + root.pos_emb(torch.arange(t, device=idx.device))


def gpt_layers(vocab=67, d_model=48, heads=4, layers=2, seq_len=32, seed=0,
               dropout=0.0) -> LayerStack:
    """The GPT as layers: embeddings, one per block, final LayerNorm + tied head."""
    def tok_weight():  # the tied tensor: the same initial value wherever it is built
        return seeded(seed, -1, lambda: torch.randn(vocab, d_model) * 0.02)

    def embed():
        def build():
            mods = {"tok_emb": nn.Embedding(vocab, d_model), "pos_emb": nn.Embedding(seq_len, d_model)}
            nn.init.normal_(mods["pos_emb"].weight, std=0.02)
            return mods
        mods = seeded(seed, 0, build)
        with torch.no_grad():
            mods["tok_emb"].weight.copy_(tok_weight())
        return mods

    def block(i):
        def build():
            b = GPTBlock(d_model, heads, dropout=dropout)
            _init_(b, f"blocks.{i}", layers)
            return {f"blocks.{i}": b}
        return lambda: seeded(seed, i + 1, build)

    def head():
        def build():
            mods = {"ln_f": nn.LayerNorm(d_model), "head": nn.Linear(d_model, vocab, bias=False)}
            return mods
        mods = seeded(seed, layers + 1, build)
        with torch.no_grad():
            mods["head"].weight.copy_(tok_weight())
        return mods

    out = [PipeLayer("embed", embed, _embed)]
    out += [PipeLayer(f"blocks.{i}", block(i),
                      lambda root, x, i=i: root.get_submodule(f"blocks.{i}")(x))
            for i in range(layers)]
    out.append(PipeLayer("head", head, lambda root, x: root.head(root.ln_f(x))))
    return LayerStack(out, tied={"head.weight": "tok_emb.weight"}, tp_plan=tp_plan(heads))


def lm_loss(logits, targets):
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# Tensor parallel may swap it for the vocab-parallel cross-entropy (no full logits anywhere).
lm_loss.cross_entropy = True


def factory(seed=0, *, vocab=67, d_model=48, heads=4, layers=2, seq_len=32, n_samples=2048,
            branching=3, dropout=0.0):
    """Return (GPT, Markov-chain token data set, lm_loss)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(vocab, d_model, heads, layers, seq_len, seed, dropout)
    data = make_markov_tokens(n_samples, seq_len, vocab, seed, branching)
    return model, data, lm_loss


def pipeline(seed=0, *, vocab=67, d_model=48, heads=4, layers=2, seq_len=32, n_samples=2048,
             branching=3, dropout=0.0):
    """Return (LayerStack of the GPT factory's model, its data set, lm_loss); builds no weights."""
    stack = gpt_layers(vocab, d_model, heads, layers, seq_len, seed, dropout)
    return stack, make_markov_tokens(n_samples, seq_len, vocab, seed, branching), lm_loss
