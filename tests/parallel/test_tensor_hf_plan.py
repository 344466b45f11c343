"""A Hugging Face model's own tensor-parallel plan (model._tp_plan), translated: whole heads
for the attention projections, the vocabulary split for embedding and head, and an error
naming a style hpctrain does not run (no guess). GPT-2, which carries none, gets one (its
Conv1D layers cut along their transposed dims, the fused q/k/v as 3 parts of whole heads,
each attention's head count per rank); a vocabulary no tp divides is padded; the layers the
pipeline splits a model into keep its plan. Pure: no MPI."""

from types import SimpleNamespace

import pytest
import torch

from hpctrain.models.chain import split_model
from hpctrain.parallel.tensor import check, model_plan
from hpctrain.parallel.tensor.checks import Split
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
    with pytest.raises(ValueError, match="2 attention heads do not split over tp=4"):
        check(model, None, 4, hf_models.lm_loss)  # checked, not cut (the k/v heads)


def test_a_style_without_an_equivalent_is_named():
    model = SimpleNamespace(_tp_plan={"layers.*.mlp.up_proj": "local_colwise"},
                            config=SimpleNamespace(num_attention_heads=4))
    with pytest.raises(ValueError, match="local_colwise"):
        plan_of(model)
    assert plan_of(SimpleNamespace(tp_plan={"a": "colwise"})) is None  # not a HF model


def test_gpt2_gets_megatrons_plan_with_conv1d_cut_along_its_transposed_dims():
    from tests.fixtures import hf_models

    model = hf_models.gpt2_tp_factory()[0]
    assert model.config.pad_token_id == 1 and getattr(model, "_tp_plan", None) in (None, {})
    plan = model_plan(model)
    assert plan["transformer.h.*.attn.c_attn"] == {"style": "colwise", "parts": 3, "heads": 4}
    assert plan["transformer.h.*.attn"]["style"] == "per_rank"
    styles, splits, vocab = check(model, None, 4, hf_models.lm_loss)
    assert vocab == 97
    assert splits["transformer.h.0.attn.c_attn.weight"] == Split(1, 3)  # (in, 3 x out)
    assert splits["transformer.h.0.attn.c_attn.bias"] == Split(0, 3)
    assert splits["transformer.h.0.attn.c_proj.weight"] == Split(0)  # rowwise: in = dim 0
    assert "transformer.h.0.attn.c_proj.bias" not in splits  # added once, whole
    assert splits["transformer.h.0.mlp.c_fc.weight"] == Split(1)
    # the vocabulary (97) padded to a multiple of tp; the tied head cut alike
    assert splits["transformer.wte.weight"] == splits["lm_head.weight"] == Split(0, padded=97)
    assert [Split(0, padded=97).rows(r, 4, 97) for r in range(4)] == \
        [(0, 25), (25, 25), (50, 25), (75, 22)]
    with pytest.raises(ValueError, match=r"\(per_rank\): num_heads = 4 does not split over"):
        check(model, None, 8, hf_models.lm_loss)
    # a padded vocabulary is held unevenly: the sharded dp flavours are refused, ddp is not
    check(model, None, 4, hf_models.lm_loss, "ddp", 2)
    check(model, None, 4, hf_models.lm_loss, "zero3", 1)
    with pytest.raises(ValueError, match=r"with zero3 over dp=2: the vocabulary of 97 \("
                                         r"lm_head.weight\) is padded to a multiple of tp, so "
                                         r"the tp ranks hold 25 and 22 rows"):
        check(model, None, 4, hf_models.lm_loss, "zero3", 2)


def test_the_pipelines_layers_keep_the_models_plan():
    """The pipeline splits a model into a LayerStack (models/chain.py): its plan is the
    model's, so pp x tp runs from it (the stack alone has none)."""
    from tests.fixtures import hf_models

    sample = torch.zeros(2, hf_models.SEQ_LEN, dtype=torch.long)
    for model in (hf_models.llama_pp_tp_factory()[0], hf_models.gpt2_tp_factory()[0]):
        stack = split_model(model, sample)
        assert not stack.tp_plan and model_plan(stack) == model_plan(model) != {}
        assert check(stack, None, 2, hf_models.lm_loss)[2] == 97
    emb = hf_models.llama_pp_tp_factory()[0].model.embed_tokens
    assert emb.padding_idx == 1  # split like any other embedding
