"""Checkpoint metadata is checksummed and validated: a changed step or lr is refused by resume
and by `ckpt inspect` alike, malformed or wrong-typed attributes are named, older files load
with a warning; what every torch optimizer and schedule saves passes the type checks."""

import json

import pytest

from tests.checkpoint.forge import FORGERIES
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
    "lr_string": "attribute 'optim_param_groups' group 0 has 'lr' = '0.003' (a string), "
                 "expected a number",
    "betas_short": "group 0 has 'betas' = [0.9] (a list), expected a pair of numbers",
    "sampler_step_string": "attribute 'sampler_state' has 'step' = '2' (a string), expected an "
                           "integer >= 0",
    "schedule_epoch_string": "attribute 'lr_schedule' 'state' has 'last_epoch' = '1' (a "
                             "string), expected an integer",
    "world_size_string": "attribute 'world_size' is '1', expected an integer >= 1",
    "rng_floats": "dataset 'rng/torch_cpu' is float32 of shape (1, 5056), expected uint8 of "
                  "shape (world size, 5056)",
    "absurd_shape": FORGERIES["absurd_shape"][1],
    "virtual_elsewhere": FORGERIES["virtual_elsewhere"][1],
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


def test_every_torch_optimizer_and_schedule_passes_the_type_checks():
    # The table of known keys must never refuse what torch itself saves (Adafactor's eps is
    # a pair with a null; Muon and LBFGS have keys of their own, checked on resume).
    import inspect as pyinspect

    import torch
    from torch.optim import lr_scheduler

    from hpctrain.checkpoint.meta import _value_problems, param_group_problems

    checked = 0
    for name, cls in vars(torch.optim).items():
        if not (pyinspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)
                and cls is not torch.optim.Optimizer):
            continue
        opt = cls([torch.nn.Parameter(torch.ones(2, 2))])
        saved = json.loads(json.dumps([{**{k: v for k, v in g.items() if k != "params"},
                                        "params": ["w"]} for g in opt.param_groups]))
        assert _value_problems("optim_param_groups", saved) == [], name
        assert param_group_problems(saved, opt.param_groups, name) == [], name
        checked += 1
    assert checked >= 14
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for sched in (lr_scheduler.OneCycleLR(opt, 1.0, total_steps=10),
                  lr_scheduler.ReduceLROnPlateau(opt)):
        state = json.loads(json.dumps({"name": "x", "steps_done": 0, "state": sched.state_dict()},
                                      default=str))
        assert _value_problems("lr_schedule", state) == [], type(sched).__name__


def test_param_groups_of_an_optimizer_the_table_does_not_know():
    # On resume the live optimizer says what each saved value must be (Adafactor's own keys).
    import torch

    from hpctrain.checkpoint.meta import param_group_problems

    live = torch.optim.Adafactor([torch.nn.Parameter(torch.ones(2, 2))]).param_groups
    saved = [{"lr": 0.02, "beta2_decay": "-0.8", "eps": [None, 0.001], "d": 1.0,
              "maximize": 0, "foreach": True, "params": ["w"]}]
    assert param_group_problems(saved, live, "Adafactor") == [
        "attribute 'optim_param_groups' group 0 has 'beta2_decay' = '-0.8' (a string), expected "
        "a number as Adafactor holds",
        "attribute 'optim_param_groups' group 0 has 'maximize' = 0 (an integer), expected true "
        "or false as Adafactor holds"]
