"""The tensor-parallel plan a Hugging Face model carries, in hpctrain's styles.

transformers models declare how their layers split (``model._tp_plan``: module-name patterns
with ``*`` for the layer index, as hpctrain's plans; Llama, Mistral, Qwen, ... have one).
Translating it lets ``strategy="tensor"`` take such a model as it is, with no [tensor.plan]:
the attention projections keep whole heads (the config's head counts), the embedding and
output head split over the vocabulary and the loss becomes the vocabulary-parallel
cross-entropy. A style with no hpctrain equivalent is an error naming it, never a guess.
"""

from __future__ import annotations

__all__ = ["plan_of"]

_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "vocab_embedding",
           "colwise_gather_output": "vocab_head"}


def plan_of(model) -> dict | None:
    """hpctrain's plan for a Hugging Face ``model`` (None: it carries none); ValueError for
    a style that hpctrain cannot run."""
    hf, config = getattr(model, "_tp_plan", None), getattr(model, "config", None)
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
