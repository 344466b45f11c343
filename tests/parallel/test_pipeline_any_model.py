"""Pipelines of models that are not nn.Sequential (issue 21): Hugging Face GPT-2 (lm_head tied
to wte across stages) and Llama (rotary embeddings recomputed in each stage; head tied and
untied), and a generic embeddings -> ModuleList -> norm -> head model, split by
hpctrain.models.chain. 20 fp32 steps at pp=2 (balanced by parameter count; and through
`python -m hpctrain train` at a named module split point), pp=2 x dp=2 with zero3/zero1, and
zero3 of the same factory, all within rtol 1e-5 of one process. In the same launches: a
chain returning {"logits": ...} at pp=2; the plain GPT2LMHeadModel on pad-to-longest dict
batches (input_ids + attention_mask) through Trainer.fit at pp=2 and pp=2 x dp=2 (NCCL's
ordered issue order), validation included; Hugging Face style labels (shifted inside the
loss) with tokens weighting, the count declared under zero3 and measured under pp=2, and the
control counted as given; Llama's attention dropout accepted per rank at pp=2, said once
under zero3, refused at tp=2. In the session's launches (1, 2 and 4 ranks; the command line
at 2).
Plus the split itself (exact logits, with a padding mask too, ties, split points by module
name, dict outputs, inputs the layers do not take) and a model whose forward is not a chain
(one error line, exit 2, before MPI).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpctrain.models.chain import split_model
from hpctrain.models.gpt import GPT
from hpctrain.parallel.pipeline import plan
from hpctrain.parallel.pipeline.transform import _module_layers
from tests.fixtures import chain_models, hf_models
from tests.mpirun import ROOT, mpi_env
from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "pipeline_any_worker.py")
GPT2 = "tests.fixtures.hf_models:gpt2_factory"
LLAMA = "tests.fixtures.hf_models:llama_factory"
LLAMA_TIED = "tests.fixtures.hf_models:llama_tied_factory"
GENERIC = "tests.fixtures.chain_models:generic_factory"
NOT_A_CHAIN = "tests.fixtures.chain_models:not_a_chain_factory"
DICT_OUT = "tests.fixtures.chain_models:dict_factory"
SHIFTED = "tests.fixtures.hf_models:gpt2_shifted_factory"
UNCOUNTED = "tests.fixtures.hf_models:gpt2_shifted_uncounted_factory"
MISCOUNTED = "tests.fixtures.hf_models:gpt2_shifted_miscounted_factory"
LLAMA_DROPOUT = "tests.fixtures.hf_models:llama_dropout_factory"
TOKENS = {"loss_weight": "tokens"}


def _case(cid, model, strategy="single", mesh=None, flavour=None, ref=None, train=None,
          **pipeline):
    runtime = {k: v for k, v in (("mesh", mesh), ("dp_flavour", flavour)) if v}
    return {"id": cid, "ref": ref, "overrides": {
        "train": {"model": model, "strategy": strategy, **(train or {})}, "runtime": runtime,
        "pipeline": pipeline}}


def _fit(cid, ref=None, **kwargs):
    """GPT2LMHeadModel on pad-to-longest dict batches (input_ids, attention_mask) through
    Trainer.fit (tests/fixtures/hf_models.py:fit_masked)."""
    return {"id": cid, "ref": ref, "fit": "tests.fixtures.hf_models:fit_masked",
            "kwargs": kwargs}


REFS = [_case(m, m) for m in (GPT2, LLAMA, LLAMA_TIED, GENERIC, DICT_OUT)] + [
    _case("shifted", SHIFTED, train=TOKENS), _fit("masked")]
TWO = [
    _case("gpt2-pp2", GPT2, "pipeline", "pp=2", ref=GPT2),
    _case("llama-pp2", LLAMA, "pipeline", "pp=2", ref=LLAMA),
    _case("llama-tied-pp2-interleaved", LLAMA_TIED, "pipeline", "pp=2", ref=LLAMA_TIED,
          schedule="interleaved-1f1b", split_points="model.layers.1,model.layers.3,lm_head"),
    _case("generic-pp2", GENERIC, "pipeline", "pp=2", ref=GENERIC),
    _case("gpt2-zero3", GPT2, "zero3", ref=GPT2),
    _case("dict-output-pp2", DICT_OUT, "pipeline", "pp=2", ref=DICT_OUT),
    _case("shifted-zero3", SHIFTED, "zero3", ref="shifted", train=TOKENS),
    _case("shifted-measured-pp2", UNCOUNTED, "pipeline", "pp=2", ref="shifted", train=TOKENS),
    _fit("masked-pp2", "masked", strategy="pipeline", mesh="pp=2"),
]
# Not compared with one process: the control (HF-style labels counted as given) and
# attention dropout, accepted per rank under the pipeline and said once under zero3.
OTHERS = [
    _case("miscounted-zero3", MISCOUNTED, "zero3", train=TOKENS),
    _case("dropout-pp2-per-rank", LLAMA_DROPOUT, "pipeline", "pp=2",
          train={"per_rank_dropout": True, "steps": 2}),
    _case("dropout-zero3", LLAMA_DROPOUT, "zero3", train={"steps": 2}),
    {**_case("dropout-tp2", LLAMA_DROPOUT, "tensor", "tp=2"), "refused": True},
]
FOUR = [
    _case("gpt2-pp2-dp2-zero3", GPT2, "pipeline", "pp=2,dp=2", "zero3", ref=GPT2),
    _case("llama-pp2-dp2-zero1", LLAMA, "pipeline", "pp=2,dp=2", "zero1", ref=LLAMA),
    _fit("masked-pp2-dp2-ordered", "masked", strategy="pipeline", mesh="pp=2,dp=2",
         dp_flavour="ddp", p2p="ordered"),
]
# The command line itself, with stages starting at a named module: the worker's defaults.
CLI = {"id": "gpt2-pp2-split-cli", "ref": GPT2, "args": [
    "-m", "hpctrain", "train", "--model", GPT2, "--strategy", "pipeline", "--mesh", "pp=2",
    "--set", "pipeline.split_points=transformer.h.1", "--steps", "20",
    "--global-batch-size", "16", "--optimizer", "adamw", "--lr", "0.003",
    "--weight-decay", "0.01", "--progress", "off"]}


def _steps(tmp):
    """The worker's launches (1, 2 and 4 ranks) and the command line at 2 ranks, in the
    session's launches (tests/parallel/train_cases.py)."""
    return [script_step(tmp, "single", None, WORKER, REFS, ["{out}", "{cases}"]),
            script_step(tmp, "two", 2, WORKER, TWO + OTHERS, ["{out}", "{cases}"]),
            script_step(tmp, "four", 4, WORKER, FOUR, ["{out}", "{cases}"]),
            {"id": "cli", "world": 2, "argv": CLI["args"] + ["--out-dir", str(tmp / "cli")]}]


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    got = {k: v for tag in ("single", "two", "four") for k, v in script_output(res, tag).items()}
    cli = res["cli"]
    assert cli["rc"] == 0, cli["stdout"][-3000:] + cli["stderr"][-3000:]
    summary = json.loads((res["_tmp"] / "cli" / "summary.json").read_text())
    got[CLI["id"]] = {"losses": summary["losses"], "param_norm": summary["param_norm"],
                      "log": cli["stdout"]}  # rank 0's, which prints the stages
    return got


@pytest.mark.mpi
@pytest.mark.parametrize("case", TWO + FOUR + [CLI], ids=lambda c: c["id"])
def test_trains_as_one_process(results, case):
    got, ref = results[case["id"]], results[case["ref"]]
    assert len(got["losses"]) == 20
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    if "val" in ref:  # Trainer.fit cases: validated at the end
        assert len(ref["val"]) == 1
        np.testing.assert_allclose(got["val"], ref["val"], rtol=1e-5, atol=0)


@pytest.mark.mpi
def test_hf_style_labels_are_counted_as_the_loss_counts(results):
    """A loss shifting its labels inside (HF style) declares its count (shifted-zero3) or
    has it measured on the first samples, said once (shifted-measured-pp2); both follow one
    process above. The control: weighted by every label (declared so), which is not what
    it averages over, it does not."""
    assert results["shifted-measured-pp2"]["log"].count(
        "the loss shifts its labels (Hugging Face style") == 1
    got, ref = results["miscounted-zero3"]["losses"], results["shifted"]["losses"]
    assert not np.allclose(got, ref, rtol=1e-5, atol=0)


@pytest.mark.mpi
def test_dropout_is_accepted_per_rank_or_said(results):
    pp, zero3 = results["dropout-pp2-per-rank"]["log"], results["dropout-zero3"]["log"]
    assert "model.layers.0.self_attn (dropout at modeling_llama.py" in pp
    assert "masks are drawn per rank and piece (train.per_rank_dropout = true)" in pp
    assert zero3.count("hpctrain: note: dropout > 0") == 1
    assert "each data-parallel rank draws the masks of its own samples" in zero3
    refused = results["dropout-tp2"]["error"]  # the same one line on every rank
    assert refused.startswith("plan 'tensor") and "\n" not in refused
    assert "model.layers.0.self_attn (dropout at modeling_llama.py" in refused
    assert "set it to 0" in refused and "train.per_rank_dropout = true" in refused


@pytest.mark.mpi
def test_split_points_name_modules(results):
    assert "stages 0:transformer.wte..transformer.h.0 | 1:transformer.h.1..lm_head" \
        in results[CLI["id"]]["log"]


@pytest.mark.parametrize("factory", [hf_models.gpt2_factory, hf_models.llama_factory,
                                     hf_models.llama_tied_factory, chain_models.generic_factory])
def test_layers_compute_the_models_logits_exactly(factory):
    model, data, _ = factory()
    x = torch.stack([data[i][0] for i in range(4)])
    stack = split_model(model, x)
    with torch.no_grad():
        h = x
        for layer in stack.layers:
            h = layer.forward(model, h)
        assert torch.equal(h, model(x))


@pytest.mark.parametrize("build", [hf_models.gpt2_model, hf_models.llama_model])
def test_sdpa_models_split_exactly_too(build):
    model, x = build(attention="sdpa"), torch.randint(0, hf_models.VOCAB, (3, hf_models.SEQ_LEN))
    stack = split_model(model, x)  # checked against model(x) inside
    with torch.no_grad():
        h = x
        for layer in stack.layers:
            h = layer.forward(model, h)
        assert torch.equal(h, model(x))


def test_ties_are_declared():
    gpt2, llama, tied = (split_model(f()[0]) for f in (
        hf_models.gpt2_factory, hf_models.llama_factory, hf_models.llama_tied_factory))
    assert gpt2.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert llama.tied == {}
    assert tied.tied == {"lm_head.weight": "model.embed_tokens.weight"}


def test_split_points_accept_module_paths():
    stack = split_model(hf_models.gpt2_factory()[0])
    names = [layer.name for layer in stack.layers]
    assert names[0] == "transformer.wte" and names[-2:] == ["transformer.ln_f", "lm_head"]
    modules = _module_layers(stack)
    assert plan.split_at("transformer.h.2", names, 2, modules) == [0, 3]
    assert plan.split_at(["transformer.h.1", "transformer.ln_f"], names, 3, modules) == [0, 2, 5]
    with pytest.raises(ValueError, match="neither a layer index"):
        plan.split_at("transformer.h.9", names, 2, modules)


def test_a_forward_that_is_not_a_chain_is_refused():
    model, data, _ = chain_models.not_a_chain_factory()
    with pytest.raises(TypeError, match="is not the chain of its layers"):
        split_model(model, torch.stack([data[0][0], data[1][0]]))
    # hpctrain's own GPT adds position embeddings in its forward: not a chain of modules.
    gpt = GPT(vocab=50, d_model=16, heads=2, layers=2, seq_len=8)
    with pytest.raises(TypeError, match="GPT: running its layers .* one after the other"):
        split_model(gpt, torch.randint(0, 50, (2, 8)))
    with pytest.raises(TypeError, match="no nn.ModuleList"):
        split_model(torch.nn.Bilinear(2, 2, 2))


def test_cli_refuses_a_model_that_is_not_a_chain():
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "train", "--model", NOT_A_CHAIN,
         "--strategy", "pipeline", "--steps", "2"],
        env=mpi_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SkipLM's forward is not the chain" in lines[0], proc.stderr
    assert "LayerStack" in lines[0] and "split_points" in lines[0]


def _plain(kind, attention):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    model = hf_models.gpt2_model(attention=attention) if kind == "gpt2" else \
        hf_models.llama_model(attention=attention)
    plain = (GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM)(model.config)
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_dict_inputs_with_a_padding_mask_split_exactly(kind, attention):
    from hpctrain.models.layers import run_layer, split_input

    plain = _plain(kind, attention)
    mask = torch.ones(3, hf_models.SEQ_LEN, dtype=torch.long)
    mask[1, 9:], mask[2, 4:] = 0, 0  # right padding, as a collator pads to the longest
    x = {"input_ids": torch.randint(0, hf_models.VOCAB, (3, hf_models.SEQ_LEN)),
         "attention_mask": mask}
    stack = split_model(plain, x)  # checked against plain(**x) inside
    h, side = split_input(stack.inputs, x)
    with torch.no_grad():
        for layer in stack.layers:
            h = run_layer(layer, plain, h, side)
        want = plain(**x)
    assert type(h) is type(want) and torch.equal(h.logits, want.logits)
    assert stack.inputs == ("input_ids", "attention_mask")


def test_dict_outputs_are_kept_and_other_inputs_refused():
    model, data, _ = chain_models.dict_factory()
    x = torch.stack([data[0][0], data[1][0]])
    stack = split_model(model, x)
    h = x
    with torch.no_grad():
        for layer in stack.layers:
            h = layer.forward(model, h)
        assert type(h) is dict and torch.equal(h["logits"], model(x)["logits"])

    class TwoOutputs(chain_models.ChainLM):
        def forward(self, ids):
            logits = super().forward(ids)
            return {"logits": logits, "aux": logits.mean()}
    with pytest.raises(TypeError, match=r"it returns a dict of \['aux', 'logits'\]"):
        split_model(TwoOutputs(), x)
    ids = {"input_ids": x, "token_type_ids": torch.zeros_like(x)}
    with pytest.raises(TypeError, match=r"has keys \['input_ids', 'token_type_ids'\]; drop "
                                        r"\['token_type_ids'\]"):
        split_model(_plain("gpt2", "sdpa"), ids)
    with pytest.raises(TypeError, match="passes one tensor through the model's layers"):
        split_model(chain_models.generic_factory()[0], {"input_ids": x})
