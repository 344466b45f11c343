"""A Hugging Face GPT-2 (tiny, random init; Llama passed too, left out for the suite's time)
trained through hpctrain.Trainer.fit with a torch DataLoader, AdamW and warm-up + cosine:
zero3 at 2 ranks and pipeline pp=2 follow one process; a fit stopped mid-epoch and resumed
from its checkpoint reproduces the uninterrupted one (the schedule included), under single
and zero3; the validation loss is equal."""

import json

import pytest
import torch

from tests.mpirun import run_mpi, run_single

WORKER = "tests/train/fit_hf_worker.py"


def _run(tmp_path, name, ranks, *args):
    out = tmp_path / f"{name}.json"
    (run_mpi(ranks, [WORKER, str(out), *args]) if ranks > 1 else
     run_single([WORKER, str(out), *args]))
    return json.loads(out.read_text())


def _close(got, want, what):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0,
                               msg=what)


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["gpt2"])  # llama: the same path (test_pipeline_any_model)
def test_hf_models_through_fit_follow_one_process_and_resume_mid_epoch(tmp_path, which):
    want = _run(tmp_path, "single", 1, "single", which)
    assert len(want["losses"]) == 16 and want["losses"][-1] < want["losses"][0]
    for strategy in ("zero3", "pipeline"):
        got = _run(tmp_path, strategy, 2, strategy, which)
        _close(got["losses"], want["losses"], f"{which} {strategy}")
        _close([got["val"]], [want["val"]], f"{which} {strategy} validation")
    if which == "gpt2":  # resume: steps 1-7, a checkpoint, then 8-16 in a new fit
        for name, ranks in (("single", 1), ("zero3", 2)):
            resumed = _run(tmp_path, f"resumed-{name}", ranks, name, which,
                           str(tmp_path / f"ck-{name}"))
            _close(resumed["losses"], want["losses"], f"resumed {name}")
