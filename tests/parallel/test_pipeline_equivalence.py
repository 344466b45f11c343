"""Pipeline (pp=2, pp=4, dp=2 x pp=2) x (gpipe, 1f1b, interleaved-1f1b) x (mlp, gpt) x
(sgd, adamw) reproduces single-process training: losses over 20 steps within rtol 1e-5, with
the eager p2p issue order (CPU) and the ordered one (NCCL's rules, emulated over MPI)."""

import os

import pytest

from tests.parallel.equivalence import Case, assert_case, worker_results, worker_steps
from tests.parallel.train_cases import pool, pooled_results

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


def _row(ranks, name, case):
    """A case row: ``case`` (the worker's) follows the reference of its "key"."""
    return Case(name, ranks, case, ref="-".join(map(str, case["key"])), strategy="pipeline",
                keys=("losses", "param_norm"))


def _cases(ranks, mesh):
    """The table's rows at ``mesh`` (``ranks`` ranks)."""
    cases = []
    for i, (model, opt, sched) in enumerate((m, o, s) for m in MODELS for o in ("sgd", "adamw")
                                            for s in SCHEDULES):
        accum = 2 if i % 5 == 0 else 1  # a few cases also accumulate gradients
        cases.append(_row(ranks, f"{mesh}-{model}-{opt}-{sched}-a{accum}",
                          {"train": {**_train(model, opt, accum), "strategy": "pipeline"},
                           "pipeline": {"schedule": sched, "microbatches": 4,
                                        "virtual_stages": 2},
                           "runtime": {"mesh": mesh}, "key": [model, opt, accum]}))
    # Stages split by layer times measured on every rank: whatever split the (noisy) times
    # give, all ranks must agree on it and training must still match single-process. GPT's
    # last layer (the tied head) is timed with its cross-entropy loss.
    for model, opt in (("mlp", "sgd"), ("gpt", "adamw")):
        cases.append(_row(ranks, f"{mesh}-{model}-{opt}-1f1b-measured",
                          {"train": {**_train(model, opt), "strategy": "pipeline"},
                           "pipeline": {"schedule": "1f1b", "microbatches": 4,
                                        "balance": "measured"},
                           "runtime": {"mesh": mesh}, "key": [model, opt, 1]}))
    # The ordered issue order (what NCCL runs: grouped sends and receives matched by order
    # alone, tag 0) with synchronous MPI sends: a send completes only when its receive runs,
    # as on NCCL, so an order that would hang or pair the wrong messages there fails here.
    for model, opt, sched, m in (("gpt", "adamw", "gpipe", 4), ("mlp", "sgd", "1f1b", 4),
                                 ("gpt", "sgd", "interleaved-1f1b", 4),
                                 ("mlp", "adamw", "interleaved-1f1b", 8)):
        cases.append(_row(ranks, f"{mesh}-{model}-{opt}-{sched}-m{m}-ordered",
                          {"train": {**_train(model, opt), "strategy": "pipeline"},
                           "pipeline": {"schedule": sched, "microbatches": m,
                                        "virtual_stages": 2, "p2p": "ordered"},
                           "runtime": {"mesh": mesh}, "key": [model, opt, 1]}))
    return cases


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")


# The equivalence table: the one-process references, the pp=2 rows, and both 4-rank meshes
# in one launch (each row sets its own mesh), all in the session's launches (train_cases.pool).
ROWS = {mesh: _cases(ranks, mesh) for ranks, mesh in MESHES}
REFS = [Case("-".join(map(str, k)), None, {"train": _train(*k)})
        for k in sorted({tuple(c.run["key"]) for rows in ROWS.values() for c in rows})]
TABLE = REFS + [c for rows in ROWS.values() for c in rows]

pool(__name__, lambda tmp: worker_steps(tmp, WORKER, TABLE, id_key="name"), "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return worker_results(pooled_results(__name__, tmp_path_factory), TABLE)


@pytest.mark.parametrize("ranks,mesh", MESHES,
                         ids=[m.replace("=", "").replace(",", "_") for _, m in MESHES])
def test_pipeline_matches_single(runs, ranks, mesh):
    for c in ROWS[mesh]:
        assert_case(runs, c)
