"""Every dp flavour over the replicas of pipeline stages (ddp with awkward params, zero1-3, fsdp
FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD) at --mesh dp=2,pp=2: training reproduces single-process
(losses over 20 steps within rtol 1e-5), optimizer state (zero1) and gradients (zero2) are 1/dp
per rank, and checkpoints load across single / pipeline ddp / pipeline zero.

Five worker runs (single, 2 ranks, 4 ranks, then single and 3 ranks), shared by the tests
through one module fixture and run in the session's launches (tests/parallel/train_cases.py):
MPI start-up dominates these small runs."""

import os

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

pytestmark = pytest.mark.mpi

STEPS = 20
AWKWARD = "tests.fixtures.pipe_awkward:factory"   # buffer, frozen and never-used params
MODELS = {"mlp": {"layers": 8}, "gpt": {"layers": 6}, AWKWARD: {}}
LR = {"sgd": {"mlp": 0.1, "gpt": 0.3, AWKWARD: 0.3}, "adamw": 0.003}
# (mode, model, optimizer, schedule, grad_accum, max_grad_norm): every schedule in both modes,
# each mode with both built-in models and both optimizers; clipping in both modes.
EQUIV = [
    ("zero1", "gpt", "adamw", "gpipe", 1, 0.0),
    ("zero1", "mlp", "sgd", "1f1b", 2, 0.0),
    ("zero1", "mlp", "adamw", "interleaved-1f1b", 1, 0.05),
    ("zero2", "gpt", "sgd", "interleaved-1f1b", 1, 0.5),
    ("zero2", "mlp", "adamw", "gpipe", 1, 0.0),
    ("zero2", "gpt", "adamw", "1f1b", 2, 0.0),
    ("zero1", AWKWARD, "adamw", "1f1b", 1, 0.0),
    ("zero2", AWKWARD, "sgd", "gpipe", 2, 0.0),
    # plain ddp over dp: frozen and never-used params must keep no gradient (weight decay
    # and momentum would move them)
    ("ddp", AWKWARD, "adamw", "interleaved-1f1b", 1, 0.0),
    # parameters sharded too (the executor gathers each unit around its chunks' actions),
    # GPT's embedding tied across the first and last stage
    ("zero3", "gpt", "adamw", "1f1b", 2, 0.5),
    ("zero3", AWKWARD, "sgd", "interleaved-1f1b", 1, 0.0),
    ("fsdp", "gpt", "adamw", "gpipe", 1, 0.0),
    ("fsdp:SHARD_GRAD_OP", "mlp", "adamw", "1f1b", 2, 0.0),
    ("fsdp:HYBRID_SHARD", "gpt", "sgd", "1f1b", 1, 0.0),
]
# At 2 ranks: one stage sharded over dp=2 (GPT's tied weight shared on one rank), and a
# pp=2 pipeline whose shards span one rank (dp=1).
TWO = [("zero2", "gpt", "adamw", "1f1b", 2, 0.0, "dp=2,pp=1"),
       ("zero1", "mlp", "sgd", "interleaved-1f1b", 2, 0.5, "pp=2")]
CKPT_TRAIN = {"model": "gpt", "model_options": {"layers": 4}, "optimizer": "adamw", "lr": 0.003,
              "steps": 10, "global_batch_size": 16, "weight_decay": 0.01}


def _train(model, opt, accum, clip, steps=STEPS):
    lr = LR[opt] if opt == "adamw" else LR[opt][model]
    return {"model": model, "model_options": MODELS[model], "optimizer": opt, "lr": lr,
            "steps": steps, "global_batch_size": 16, "grad_accum": accum, "weight_decay": 0.01,
            "momentum": 0.5 if opt == "sgd" else 0.0, "max_grad_norm": clip}


def _key(model, opt, accum, clip):
    return f"{model}-{opt}-a{accum}-c{clip}"


def _pp(name, train, mode, sched="1f1b", mesh="dp=2,pp=2", ck=None, resume="", memory=False):
    flavour, _, sharding = mode.partition(":")
    case = {"name": name, "train": {**train, "strategy": "pipeline"}, "runtime": {"mesh": mesh},
            "pipeline": {"schedule": sched, "microbatches": 4, "dp_sharding": flavour},
            "memory": memory}
    if sharding:
        case["fsdp"] = {"sharding_strategy": sharding}
    if sharding == "HYBRID_SHARD":  # ranks 0,1 and 2,3 share a node: dp groups in a node
        case["runtime"]["ranks_per_node"] = 2
    if ck is not None:
        case["checkpoint"] = {"dir": str(ck), "every": 5, "resume": resume}
    return case


def _single(name, ck, resume=""):
    return {"name": name, "train": {**CKPT_TRAIN, "strategy": "single"},
            "checkpoint": {"dir": str(ck), "every": 5, "resume": resume}}


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_zero_worker.py")


def _steps(tmp):
    """Five worker runs (single, 2, 4 ranks, then single and 3 ranks reading the 4-rank
    checkpoints), in the session's launches (tests/parallel/train_cases.py)."""
    refs = {_key(m, o, a, c): {"name": _key(m, o, a, c), "train": _train(m, o, a, c)}
            for _, m, o, _, a, c, *_ in EQUIV + TWO}
    single_cases = list(refs.values()) + [_single("ck-single", tmp / "s")]
    mem_train = _train("gpt", "adamw", 1, 0.0, steps=2)
    cases = [_pp(f"{mode}-{m}-{o}-{s}-a{a}-c{c}", _train(m, o, a, c), mode, s)
             for mode, m, o, s, a, c in EQUIV]
    cases += [_pp(f"mem-{mode}", mem_train, mode, memory=True)
              for mode in ("ddp", "zero1", "zero2")]
    cases += [
        _pp("ck-zero1", CKPT_TRAIN, "zero1", "gpipe", ck=tmp / "z1"),
        _pp("ck-zero2", CKPT_TRAIN, "zero2", "interleaved-1f1b", ck=tmp / "z2"),
        # a zero checkpoint into pipeline ddp at another depth (pp=4), and into the other mode
        _pp("ck-pp4<-zero1", CKPT_TRAIN, "ddp", mesh="pp=4", ck=tmp / "a",
            resume=str(tmp / "z1" / "ckpt-000005.h5")),
        _pp("ck-zero1<-zero2", CKPT_TRAIN, "zero1", ck=tmp / "b",
            resume=str(tmp / "z2" / "ckpt-000005.h5")),
        # a single-process checkpoint into pipeline zero2
        _pp("ck-zero2<-single", CKPT_TRAIN, "zero2", "gpipe", ck=tmp / "c",
            resume=str(tmp / "s" / "ckpt-000005.h5")),
        # written by pp=2 x zero3 (tied embedding sharded on two stages), read at pp=4
        _pp("ck-zero3", CKPT_TRAIN, "zero3", "1f1b", ck=tmp / "z3"),
        _pp("ck-pp4<-zero3", CKPT_TRAIN, "ddp", mesh="pp=4", ck=tmp / "f",
            resume=str(tmp / "z3" / "ckpt-000005.h5")),
    ]
    two_cases = [_pp(f"{mode}-{m}-{o}-{s}-a{a}-c{c}-{mesh}", _train(m, o, a, c), mode, s,
                     mesh=mesh) for mode, m, o, s, a, c, mesh in TWO]
    back_cases = [
        _single("ck-single<-zero2", tmp / "d", resume=str(tmp / "z2" / "ckpt-000005.h5")),
        _single("ck-single<-zero1", tmp / "e", resume=str(tmp / "z1" / "ckpt-000005.h5")),
        _single("ck-single<-zero3", tmp / "g", resume=str(tmp / "z3" / "ckpt-000005.h5"))]
    # ...and by plain zero2 on 3 ranks (no pipeline: the batch of 16 splits 6/5/5)
    three_cases = [
        {**_single("ck-zero2x3<-zero3", tmp / "h", resume=str(tmp / "z3" / "ckpt-000005.h5")),
         "train": {**CKPT_TRAIN, "strategy": "zero2"}}]
    return [script_step(tmp, "single", None, WORKER, single_cases),
            script_step(tmp, "two", 2, WORKER, two_cases),
            script_step(tmp, "four", 4, WORKER, cases, after=["single"]),  # its checkpoint
            script_step(tmp, "back", None, WORKER, back_cases, after=["four"]),
            script_step(tmp, "three", 3, WORKER, three_cases, after=["four"])]


pool(__name__, _steps, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    out = {tag: script_output(res, tag) for tag in ("single", "two", "four", "back", "three")}
    return {"single": out["single"], "two": out["two"], "four": out["four"],
            "back": {**out["back"], **out["three"]}}


@pytest.mark.parametrize("mode,model,opt,sched,accum,clip", EQUIV,
                         ids=[f"{e[0]}-{e[1].split(':')[-1].split('.')[-1]}-{e[2]}-{e[3]}"
                              for e in EQUIV])
def test_pipeline_zero_matches_single(runs, mode, model, opt, sched, accum, clip):
    ref = runs["single"][_key(model, opt, accum, clip)]
    got = runs["four"][f"{mode}-{model}-{opt}-{sched}-a{accum}-c{clip}"]
    assert got["strategy"] == "pipeline" and len(got["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)


@pytest.mark.parametrize("mode,model,opt,sched,accum,clip,mesh", TWO,
                         ids=[f"{e[0]}-{e[1]}-{e[6]}" for e in TWO])
def test_pipeline_zero_matches_single_at_two_ranks(runs, mode, model, opt, sched, accum, clip,
                                                   mesh):
    ref = runs["single"][_key(model, opt, accum, clip)]
    got = runs["two"][f"{mode}-{model}-{opt}-{sched}-a{accum}-c{clip}-{mesh}"]
    assert len(got["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)


def test_pipeline_zero_memory_is_one_over_dp(runs):
    rep = {mode: runs["four"][f"mem-{mode}"]["memory"] for mode in ("ddp", "zero1", "zero2")}
    for rank in range(4):
        ddp, z1, z2 = (rep[m][rank] for m in ("ddp", "zero1", "zero2"))
        assert ddp["dp"] == z1["dp"] == z2["dp"] == 2 and ddp["pp"] == 2
        assert ddp["optimizer"] > 0 and ddp["grads"] > 0
        # ~1/2: shards are padded to a multiple of dp; Adam keeps one step per unit, not per param.
        for mode, r in (("zero1", z1), ("zero2", z2)):
            assert 0.49 < r["optimizer"] / ddp["optimizer"] < 0.51, (rank, mode, r, ddp)
            assert r["params"] >= ddp["params"], (rank, mode)  # full params: the layers use them
        assert 1.0 <= z1["grads"] / ddp["grads"] < 1.01, (rank, z1, ddp)   # full, flat
        assert 0.5 <= z2["grads"] / ddp["grads"] < 0.51, (rank, z2, ddp)   # shards only
        # zero2 reduced and freed the full gradients in each step's last backward, before
        # the step; zero1 and ddp keep them until the step.
        assert z2["full_grads_after_schedule"] == [0, 0] and z2["full_grads_alive"] == 0, z2
        assert min(ddp["full_grads_after_schedule"] + z1["full_grads_after_schedule"]) > 0


@pytest.mark.parametrize("name", ["ck-zero1", "ck-zero2", "ck-pp4<-zero1", "ck-zero1<-zero2",
                                  "ck-zero2<-single", "ck-single<-zero2", "ck-single<-zero1",
                                  "ck-zero3", "ck-pp4<-zero3", "ck-single<-zero3",
                                  "ck-zero2x3<-zero3"])
def test_pipeline_zero_checkpoints_resume_the_single_trajectory(runs, name):
    ref = runs["single"]["ck-single"]
    got = {**runs["four"], **runs["back"]}[name]
    assert len(got["losses"]) == 10
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
