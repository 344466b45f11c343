"""Hugging Face GPT-2 and Llama (tiny, random init) trained through hpctrain.Trainer.fit with a
torch DataLoader, AdamW and warm-up + cosine follow one process under ddp, zero3, fsdp and
the pipeline (pp=2) at 2 ranks, with equal validation losses. Also: the plain
GPT2LMHeadModel, whose forward returns a ModelOutput, trains with one loss on
``output.logits`` (the pipeline's last stage returns the same type); Llama trains under
tensor parallel (tp=2) from the plan the HF model carries (model._tp_plan, translated), and
GPT-2 from the one hpctrain writes for it (its vocabulary of 97 padded to a multiple of tp); a
fit stopped mid-epoch and resumed from its checkpoint reproduces the uninterrupted one (the
schedule included), under single and zero3; padded batches (plain HF models called with
input_ids and attention_mask, labels -100 at the padding) under zero3 and tensor parallel,
and as one input tensor under the pipeline (its pieces weighted by their tokens), follow
one process with train.loss_weight = tokens, and do not with the default sample weighting.
The worker runs every single-process case and every 2-rank case in the session's launches
(tests/parallel/train_cases.py)."""

import pytest
import torch

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

WORKER = "tests/train/fit_hf_worker.py"
PLANS = {"gpt2": ["zero3", "pipeline", "ddp", "fsdp", "tensor"],
         "llama": ["ddp", "zero3", "fsdp", "pipeline"],
         "gpt2-output": ["pipeline", "zero3"], "llama-tp": ["tensor"],
         "gpt2-padded": ["zero3"], "llama-padded": ["tensor"], "gpt2-padded-ids": ["pipeline"]}


def _resume(tmp):
    return {n: f"{n}:gpt2:resume:{tmp / f'ck-{n}'}" for n in ("single", "zero3")}


def _steps(tmp):
    """``WORKER OUT CASE...`` at 1 and 2 ranks in the session's launches
    (tests/parallel/train_cases.py)."""
    resume = _resume(tmp)
    single = [f"single:{m}" for m in PLANS] + [resume["single"]]
    two = ([f"{s}:{m}" for m, plans in PLANS.items() for s in plans]
           + ["zero3:gpt2-padded-by-samples", resume["zero3"]])
    return [script_step(tmp, "single", None, WORKER, [], ["{out}", *single]),
            script_step(tmp, "two", 2, WORKER, [], ["{out}", *two])]


pool(__name__, _steps, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return _resume(res["_tmp"]), script_output(res, "single"), script_output(res, "two")


def _close(got, want, what):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0,
                               msg=what)


@pytest.mark.mpi
def test_hf_models_through_fit_follow_one_process_and_resume_mid_epoch(runs):
    resume, want, got = runs
    for which, plans in PLANS.items():
        ref = want[f"single:{which}"]
        assert len(ref["losses"]) == 16 and ref["losses"][-1] < ref["losses"][0]
        for strategy in plans:
            run = got[f"{strategy}:{which}"]
            _close(run["losses"], ref["losses"], f"{which} {strategy}")
            _close([run["val"]], [ref["val"]], f"{which} {strategy} validation")
    _close(want["single:gpt2-output"]["losses"], want["single:gpt2"]["losses"], "ModelOutput")
    # the control: padded samples hold 4-16 tokens, so weighting the ranks' token means by
    # samples is not one process's mean over tokens (the tokens weighting above is)
    by_samples = torch.tensor(got["zero3:gpt2-padded-by-samples"]["losses"])
    assert not torch.allclose(by_samples, torch.tensor(want["single:gpt2-padded"]["losses"]),
                              rtol=1e-4, atol=0)
    for name, result in (("single", want), ("zero3", got)):  # steps 1-7, a checkpoint, 8-16
        _close(result[resume[name]]["losses"], want["single:gpt2"]["losses"], f"resumed {name}")
