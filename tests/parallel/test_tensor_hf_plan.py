"""A Hugging Face model's own tensor-parallel plan (model._tp_plan), translated: whole heads
for the attention projections, the vocabulary split for embedding and head, and an error
naming a style hpctrain does not run (no guess). Pure: no MPI."""

from types import SimpleNamespace

import pytest

from hpctrain.parallel.tensor import check
from hpctrain.parallel.tensor.hf_plan import plan_of


def test_llama_plan_keeps_whole_heads_and_splits_the_vocabulary():
    from tests.fixtures import hf_models

    model = hf_models.llama_tp_factory()[0]
    plan = plan_of(model)
    assert plan["model.layers.*.self_attn.q_proj"] == {"style": "colwise", "heads": 4}
    assert plan["model.layers.*.self_attn.k_proj"] == {"style": "colwise", "heads": 2}
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "vocab_embedding" and plan["lm_head"] == "vocab_head"
    styles, splits, vocab = check(model, None, 2, hf_models.lm_loss)
    assert vocab == 98 and len(splits) == 30
    with pytest.raises(ValueError, match="does not split over tp=4"):  # checked, not cut
        check(model, None, 4, hf_models.lm_loss)


def test_a_style_without_an_equivalent_is_named():
    model = SimpleNamespace(_tp_plan={"layers.*.mlp.up_proj": "local_colwise"},
                            config=SimpleNamespace(num_attention_heads=4))
    with pytest.raises(ValueError, match="local_colwise"):
        plan_of(model)
    assert plan_of(SimpleNamespace(tp_plan={"a": "colwise"})) is None  # not a HF model
