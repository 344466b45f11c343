"""Pipeline (pp=2, pp=4, dp=2 x pp=2) x (gpipe, 1f1b, interleaved-1f1b) x (mlp, gpt) x
(sgd, adamw) reproduces single-process training: losses over 20 steps within rtol 1e-5, with
the eager p2p issue order (CPU) and the ordered one (NCCL's rules, emulated over MPI)."""

import os

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

pytestmark = pytest.mark.mpi

STEPS = 20
MODELS = {"mlp": {"layers": 8}, "gpt": {"layers": 6}}   # 10 and 8 pipeline layers
LR = {("mlp", "sgd"): 0.1, ("gpt", "sgd"): 0.3, ("mlp", "adamw"): 0.003, ("gpt", "adamw"): 0.003}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
# (ranks, mesh): the meshes the issue asks for.
MESHES = [(2, "pp=2"), (4, "pp=4"), (4, "dp=2,pp=2")]


def _train(model, opt, accum=1):
    return {"model": model, "model_options": MODELS[model], "optimizer": opt, "lr": LR[(model, opt)],
            "steps": STEPS, "global_batch_size": 16, "grad_accum": accum, "weight_decay": 0.01,
            "momentum": 0.5 if opt == "sgd" else 0.0}


def _cases(mesh):
    cases = []
    for i, (model, opt, sched) in enumerate((m, o, s) for m in MODELS for o in ("sgd", "adamw")
                                            for s in SCHEDULES):
        accum = 2 if i % 5 == 0 else 1  # a few cases also accumulate gradients
        cases.append({"name": f"{mesh}-{model}-{opt}-{sched}-a{accum}",
                      "train": {**_train(model, opt, accum), "strategy": "pipeline"},
                      "pipeline": {"schedule": sched, "microbatches": 4, "virtual_stages": 2},
                      "runtime": {"mesh": mesh}, "key": [model, opt, accum]})
    # Stages split by layer times measured on every rank: whatever split the (noisy) times
    # give, all ranks must agree on it and training must still match single-process. GPT's
    # last layer (the tied head) is timed with its cross-entropy loss.
    for model, opt in (("mlp", "sgd"), ("gpt", "adamw")):
        cases.append({"name": f"{mesh}-{model}-{opt}-1f1b-measured",
                      "train": {**_train(model, opt), "strategy": "pipeline"},
                      "pipeline": {"schedule": "1f1b", "microbatches": 4, "balance": "measured"},
                      "runtime": {"mesh": mesh}, "key": [model, opt, 1]})
    # The ordered issue order (what NCCL runs: grouped sends and receives matched by order
    # alone, tag 0) with synchronous MPI sends: a send completes only when its receive runs,
    # as on NCCL, so an order that would hang or pair the wrong messages there fails here.
    for model, opt, sched, m in (("gpt", "adamw", "gpipe", 4), ("mlp", "sgd", "1f1b", 4),
                                 ("gpt", "sgd", "interleaved-1f1b", 4),
                                 ("mlp", "adamw", "interleaved-1f1b", 8)):
        cases.append({"name": f"{mesh}-{model}-{opt}-{sched}-m{m}-ordered",
                      "train": {**_train(model, opt), "strategy": "pipeline"},
                      "pipeline": {"schedule": sched, "microbatches": m, "virtual_stages": 2,
                                   "p2p": "ordered"},
                      "runtime": {"mesh": mesh}, "key": [model, opt, 1]})
    return cases


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")


def _steps(tmp):
    """The one-process references, the pp=2 cases, and both 4-rank meshes in one launch
    (each case sets its own mesh): all in the session's launches (train_cases.pool)."""
    keys = {tuple(c["key"]) for mesh in MESHES for c in _cases(mesh[1])}
    refs = [{"name": "-".join(map(str, k)), "train": _train(*k)} for k in sorted(keys)]
    return [script_step(tmp, "single", None, WORKER, refs),
            script_step(tmp, "two", 2, WORKER, _cases("pp=2")),
            script_step(tmp, "four", 4, WORKER, [c for r, m in MESHES if r == 4
                                                 for c in _cases(m)])]


pool(__name__, _steps, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return script_output(res, "single"), {**script_output(res, "two"),
                                          **script_output(res, "four")}


@pytest.mark.parametrize("ranks,mesh", MESHES,
                         ids=[m.replace("=", "").replace(",", "_") for _, m in MESHES])
def test_pipeline_matches_single(runs, ranks, mesh):
    reference, got = runs
    for c in _cases(mesh):
        ref = reference["-".join(map(str, c["key"]))]
        g = got[c["name"]]
        assert g["strategy"] == "pipeline" and len(g["losses"]) == STEPS, c["name"]
        assert g["world_size"] == ranks, c["name"]
        np.testing.assert_allclose(g["losses"], ref["losses"], rtol=1e-5, atol=0, err_msg=c["name"])
        np.testing.assert_allclose(g["param_norm"], ref["param_norm"], rtol=1e-5, err_msg=c["name"])
