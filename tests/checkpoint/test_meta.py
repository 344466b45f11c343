"""Checkpoint metadata is checksummed and validated: a changed step or lr is refused by resume
and by `ckpt inspect` alike, malformed attributes are named, older files load with a warning."""

import json

import pytest

from tests.mpirun import run_single

pytestmark = pytest.mark.mpi

# variant -> what the error must name (both `ckpt inspect` and `--resume PATH`)
REFUSED = {
    "lr_flipped": "metadata checksum mismatch",
    "step_flipped": "metadata checksum mismatch",
    "step_flipped_unsealed": "attribute 'step' is 1 but attribute 'sampler_state' is at step 2",
    "sampler_bad_json": "attribute 'sampler_state' is not valid JSON",
    "grad_scaler_missing": "attribute 'grad_scaler' is missing",
    "groups_not_list": "attribute 'optim_param_groups' holds a dict, expected a list",
    "torch_dtype_unknown": "dataset 'model/tok_emb.weight': attribute 'torch_dtype' is 'float33'",
}


@pytest.fixture(scope="module")
def variants(gpt_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("meta")
    proc = run_single(["-m", "tests.checkpoint.meta_worker", str(gpt_ckpt), str(work)],
                      timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return {v["variant"]: v for v in map(json.loads, lines)}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_damaged_metadata_refused_by_resume_and_inspect(variants, name):
    v = variants[name]
    assert "step" not in v, f"resumed at step {v.get('step')} with lr {v.get('lr')}"
    assert REFUSED[name] in v["resume_error"]
    assert v["inspect_rc"] == 1 and "hpctrain: error: " in v["stderr"]
    assert REFUSED[name] in v["stderr"].split("hpctrain: error: ", 1)[1]
    for raw in ("JSONDecodeError", "KeyError", "Traceback"):
        assert raw not in v["resume_error"] + v["stderr"]


def test_intact_and_older_unsealed_files_load(variants):
    assert variants["ok"] == {"variant": "ok", "inspect_rc": 0, "step": 2, "lr": 0.003,
                              "stderr": ""}
    old = variants["unsealed"]
    assert (old["inspect_rc"], old["step"], old["lr"]) == (0, 2, 0.003)
    assert "has no metadata checksum" in old["stderr"]
