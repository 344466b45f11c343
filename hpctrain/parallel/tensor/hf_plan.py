"""The tensor-parallel plan a Hugging Face model carries, in hpctrain's styles.

transformers models declare how their layers split (``model._tp_plan``: module-name patterns
with ``*`` for the layer index, as hpctrain's plans; Llama, Mistral, Qwen, ... have one).
Translating it lets ``strategy="tensor"`` take such a model as it is, with no [tensor.plan]:
the attention projections keep whole heads (the config's head counts), the embedding and
output head split over the vocabulary and the loss becomes the vocabulary-parallel
cross-entropy. A style with no hpctrain equivalent is an error naming it, never a guess.

GPT-2 declares no plan; it gets Megatron-LM's here: the fused ``c_attn`` (q, k, v
concatenated along its outputs) split as 3 parts of whole heads, ``c_proj`` and the MLP
column/row-wise (its ``Conv1D`` layers are transposed Linears), the embedding and the tied
head over the vocabulary, and each attention's head count and q/k/v width per rank.
"""

from __future__ import annotations

__all__ = ["plan_of"]

_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "vocab_embedding",
           "colwise_gather_output": "vocab_head"}


def plan_of(model) -> dict | None:
    """hpctrain's plan for a Hugging Face ``model`` (None: it carries none); ValueError for
    a style that hpctrain cannot run."""
    hf, config = getattr(model, "_tp_plan", None), getattr(model, "config", None)
    if getattr(config, "model_type", None) == "gpt2":
        return _gpt2_plan(model, config)
    if not isinstance(hf, dict) or not hf or config is None:
        return None
    unknown = sorted({str(v) for v in hf.values() if v not in _STYLES})
    if unknown:
        raise ValueError(f"tensor parallel: {type(model).__name__}'s Hugging Face plan uses "
                         f"{', '.join(unknown)}, which hpctrain does not run; give the plan in "
                         f"[tensor.plan] (styles: colwise, rowwise, vocab_embedding, "
                         f"vocab_head)")
    plan = {}
    for pattern, style in hf.items():
        heads = _heads(pattern, config)
        plan[pattern] = {"style": "colwise", "heads": heads} if heads else _STYLES[style]
    return plan


def _heads(pattern: str, config) -> int:
    """Heads of a query/key/value projection (split whole: a head cut in two would attend
    over half its dimensions); 0 for other layers."""
    last = pattern.rsplit(".", 1)[-1]
    if last == "q_proj":
        return int(config.num_attention_heads)
    if last in ("k_proj", "v_proj"):
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return 0


def _gpt2_plan(model, config) -> dict | None:
    """Megatron-LM's split of a GPT-2 (GPT2LMHeadModel, GPT2Model, ...); None when its
    blocks are not where GPT-2 has them."""
    body = "transformer." if hasattr(model, "transformer") else ""
    if not hasattr(getattr(model, "transformer", model), "h"):
        return None
    block = f"{body}h.*"
    plan = {f"{body}wte": "vocab_embedding",
            f"{block}.attn": {"style": "per_rank", "divide": ["split_size", "num_heads"]},
            f"{block}.attn.c_attn": {"style": "colwise", "parts": 3,
                                     "heads": int(config.n_head)},
            f"{block}.attn.c_proj": "rowwise",
            f"{block}.mlp.c_fc": "colwise",
            f"{block}.mlp.c_proj": "rowwise"}
    if hasattr(model, "lm_head"):
        plan["lm_head"] = "vocab_head"
    return plan
