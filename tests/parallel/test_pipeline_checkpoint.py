"""Pipeline checkpoints load into single/ddp and back, and at other pipeline depths: the
resumed run continues the single-process trajectory (GPT: tied weights across stages)."""

import os

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

pytestmark = pytest.mark.mpi

TRAIN = {"model": "gpt", "model_options": {"layers": 4}, "optimizer": "adamw", "lr": 0.003,
         "steps": 10, "global_batch_size": 16, "weight_decay": 0.01}


def _case(name, strategy, ckdir, resume="", mesh="", sched="1f1b"):
    return {"name": name, "train": {**TRAIN, "strategy": strategy},
            "runtime": {"mesh": mesh}, "pipeline": {"schedule": sched, "microbatches": 4},
            "checkpoint": {"dir": str(ckdir), "every": 5, "resume": resume}}


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")


def _steps(tmp):
    """Four worker runs, each reading what earlier ones wrote, in the session's launches
    (tests/parallel/train_cases.py)."""
    single_dir, pp_dir = tmp / "single", tmp / "pp2"
    return [
        script_step(tmp, "a", None, WORKER, [_case("single", "single", single_dir)]),
        # 2 ranks: pipeline from scratch; then ddp resumes the pipeline's step-5 checkpoint.
        script_step(tmp, "b", 2, WORKER, [
            _case("pp2", "pipeline", pp_dir, mesh="pp=2"),
            _case("ddp<-pp2", "ddp", tmp / "ddp", resume=str(pp_dir / "ckpt-000005.h5")),
            _case("pp2<-single", "pipeline", tmp / "pp2b", mesh="pp=2", sched="gpipe",
                  resume=str(single_dir / "ckpt-000005.h5"))], after=["a"]),
        script_step(tmp, "c", None, WORKER, [
            _case("single<-pp2", "single", tmp / "s2", resume=str(pp_dir / "ckpt-000005.h5"))],
            after=["b"]),
        script_step(tmp, "d", 4, WORKER, [
            _case("pp4<-single", "pipeline", tmp / "pp4", mesh="pp=4",
                  resume=str(single_dir / "ckpt-000005.h5")),
            _case("dp2pp2<-pp2", "pipeline", tmp / "dp2pp2", mesh="dp=2,pp=2",
                  sched="interleaved-1f1b", resume=str(pp_dir / "ckpt-000010.h5"))],
            after=["a", "b"])]


pool(__name__, _steps, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {tag: script_output(res, tag) for tag in "abcd"}


def test_pipeline_checkpoint_round_trip(runs):
    ref = runs["a"]["single"]["losses"]
    two, one, four = runs["b"], runs["c"], runs["d"]
    got = {**two, **one, **four}
    for name in ("pp2", "ddp<-pp2", "pp2<-single", "single<-pp2", "pp4<-single"):
        assert len(got[name]["losses"]) == 10, name
        np.testing.assert_allclose(got[name]["losses"], ref, rtol=1e-5, atol=0, err_msg=name)
    # Resumed at the last step: nothing left to train, the state read back must be identical.
    np.testing.assert_allclose(got["dp2pp2<-pp2"]["losses"], ref, rtol=1e-5)
    np.testing.assert_allclose(got["dp2pp2<-pp2"]["param_norm"], got["pp2"]["param_norm"], rtol=1e-6)
