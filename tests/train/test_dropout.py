"""Dropout a plan cannot make one process's (train/dropout.py, models/dropout.find_dropout):
Hugging Face attention dropout applied inside the attention function (no module shows it) is
found by tracing the forward; tensor parallel takes only hpctrain's split-invariant Dropout,
the pipeline no dropout at all, unless train.per_rank_dropout accepts per-rank masks; the
data-parallel flavours say once that masks are per rank. The command line refuses before MPI
with one line; under mpirun (tests/parallel/test_pipeline_any_model.py): tp=2 refused by
Trainer.fit on every rank, pp=2 accepted per rank, zero3 said once."""

import subprocess
import sys

import pytest
import torch

from hpctrain.errors import UsageError
from hpctrain.models.dropout import find_dropout
from hpctrain.models.gpt import factory as gpt_factory
from hpctrain.parallel.plan import ParallelPlan
from hpctrain.train.dropout import dropout_note
from tests.fixtures import hf_models
from tests.mpirun import ROOT, mpi_env

TP = ParallelPlan(tp=2, tensor=True, name="tensor")
PP = ParallelPlan(pp=2, pipeline=True, name="pipeline")
ZERO3 = ParallelPlan(dp=2, flavour="zero3", name="zero3")
LLAMA_DROPOUT = "tests.fixtures.hf_models:llama_dropout_factory"


def _ids(vocab=hf_models.VOCAB, n=16):
    return torch.randint(0, vocab, (2, n))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_functional_attention_dropout_is_found_by_the_trace(attention):
    model = hf_models.llama_model(attention=attention)
    for layer in model.model.layers:  # as config.attention_dropout = 0.1 at build time
        layer.self_attn.attention_dropout = 0.1
    before, ids = [p.detach().clone() for p in model.parameters()], _ids()
    rng = torch.get_rng_state()
    found = find_dropout(model.eval(), ids)
    wheres = [u.where for u in found]
    how = "dropout at modeling_llama.py" if attention == "eager" else \
        "scaled_dot_product_attention at sdpa_attention.py"
    assert any(w.startswith("model.layers.0.self_attn (") and how in w for w in wheres), wheres
    assert all(u.p == 0.1 and not u.exact for u in found)
    # the trace leaves the model, its mode and the RNG as they were
    assert not model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_config_fields_modules_and_nothing_at_zero():
    model = hf_models.llama_model()
    assert find_dropout(model, _ids()) == []  # p = 0: nothing, also in the trace
    model.config.attention_dropout = 0.1  # without a sample: the config says it
    assert [u.where for u in find_dropout(model)] == ["LlamaLogits.config.attention_dropout"]
    gpt2 = hf_models.gpt2_model()
    gpt2.transformer.h[1].attn.attn_dropout.p = 0.2  # a module, applied functionally too
    wheres = [u.where for u in find_dropout(gpt2, _ids())]
    assert "transformer.h.1.attn (dropout at modeling_gpt2.py:68)" in wheres[0]
    assert "transformer.h.1.attn.attn_dropout" in wheres
    ours = find_dropout(gpt_factory(0, dropout=0.1)[0], torch.randint(0, 67, (2, 32)))
    assert ours and all(u.exact for u in ours)  # hpctrain's Dropout: split-invariant


def test_plans_refuse_or_say_it():
    llama = hf_models.llama_model()
    llama.config.attention_dropout = 0.1
    uses = find_dropout(llama)
    ours = find_dropout(gpt_factory(0, dropout=0.1)[0])
    for plan in (TP, PP):
        with pytest.raises(UsageError) as err:
            dropout_note(plan, uses, per_rank=False)
        text = str(err.value)
        assert "\n" not in text and "config.attention_dropout p=0.1" in text
        assert "set it to 0" in text and "train.per_rank_dropout = true" in text
        assert "masks are drawn per rank and piece" in dropout_note(plan, uses, per_rank=True)
    assert dropout_note(TP, ours, per_rank=False) is None  # one process's masks
    with pytest.raises(UsageError, match="the pipeline runs each micro-batch in pieces"):
        dropout_note(PP, ours, per_rank=False)
    assert "each data-parallel rank draws" in dropout_note(ZERO3, uses, per_rank=False)
    assert dropout_note(ParallelPlan(), uses, per_rank=False) is None  # one process
    assert dropout_note(TP, [], per_rank=False) is None


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines()
             if line.strip() and "Warning" not in line and "return forward" not in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_cli_refuses_attention_dropout_under_the_pipeline_before_mpi():
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "train", "--model", LLAMA_DROPOUT,
         "--strategy", "pipeline", "--steps", "2", "--progress", "off"],
        env=mpi_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith("hpctrain: error: plan 'pipeline': the model has dropout > 0 "
                           "(model.layers.0.self_attn (dropout at modeling_llama.py"), line
