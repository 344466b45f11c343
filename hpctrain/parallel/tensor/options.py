"""[tensor]: the options of tensor parallel (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.option import option

__all__ = ["TensorOptions"]


@dataclass
class TensorOptions:
    """Sequence parallel on/off and a plan overriding the model's own (Megatron-LM layers
    over the mesh's tp ranks)."""

    sequence_parallel: bool = option(False, "run LayerNorm/dropout regions on sequence chunks "
                                     "(all-gather + reduce-scatter instead of all-reduce; their "
                                     "activation memory / tp)")
    plan: dict = option(None, "module-name patterns -> styles (colwise, rowwise, "
                        "vocab_embedding, vocab_head, sequence_parallel, attention_dropout; "
                        "colwise may be a table {style, parts, heads}); empty: the model's own "
                        "plan", default_factory=dict)
