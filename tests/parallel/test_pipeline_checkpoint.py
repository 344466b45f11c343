"""Pipeline checkpoints load into single/ddp and back, and at other pipeline depths: the
resumed run continues the single-process trajectory (GPT: tied weights across stages)."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single

pytestmark = pytest.mark.mpi

TRAIN = {"model": "gpt", "model_options": {"layers": 4}, "optimizer": "adamw", "lr": 0.003,
         "steps": 10, "global_batch_size": 16, "weight_decay": 0.01}


def _case(name, strategy, ckdir, resume="", mesh="", sched="1f1b"):
    return {"name": name, "train": {**TRAIN, "strategy": strategy},
            "runtime": {"mesh": mesh}, "pipeline": {"schedule": sched, "microbatches": 4},
            "checkpoint": {"dir": str(ckdir), "every": 5, "resume": resume}}


def _run(n, tmp, tag, cases):
    (tmp / f"{tag}.json").write_text(json.dumps(cases))
    args = ["-m", "tests.parallel.pipeline_worker", str(tmp / f"{tag}.json"), str(tmp / f"{tag}-out.json")]
    if n == 1:
        run_single(args, timeout=600)
    else:
        run_mpi(n, args, timeout=600)
    return json.loads((tmp / f"{tag}-out.json").read_text())


def test_pipeline_checkpoint_round_trip(tmp_path):
    single_dir, pp_dir = tmp_path / "single", tmp_path / "pp2"
    ref = _run(1, tmp_path, "a", [_case("single", "single", single_dir)])["single"]["losses"]
    # 2 ranks: pipeline from scratch; then ddp resumes the pipeline's step-5 checkpoint.
    two = _run(2, tmp_path, "b", [
        _case("pp2", "pipeline", pp_dir, mesh="pp=2"),
        _case("ddp<-pp2", "ddp", tmp_path / "ddp", resume=str(pp_dir / "ckpt-000005.h5")),
        _case("pp2<-single", "pipeline", tmp_path / "pp2b", mesh="pp=2", sched="gpipe",
              resume=str(single_dir / "ckpt-000005.h5"))])
    one = _run(1, tmp_path, "c", [
        _case("single<-pp2", "single", tmp_path / "s2", resume=str(pp_dir / "ckpt-000005.h5"))])
    four = _run(4, tmp_path, "d", [
        _case("pp4<-single", "pipeline", tmp_path / "pp4", mesh="pp=4",
              resume=str(single_dir / "ckpt-000005.h5")),
        _case("dp2pp2<-pp2", "pipeline", tmp_path / "dp2pp2", mesh="dp=2,pp=2",
              sched="interleaved-1f1b", resume=str(pp_dir / "ckpt-000010.h5"))])
    got = {**two, **one, **four}
    for name in ("pp2", "ddp<-pp2", "pp2<-single", "single<-pp2", "pp4<-single"):
        assert len(got[name]["losses"]) == 10, name
        np.testing.assert_allclose(got[name]["losses"], ref, rtol=1e-5, atol=0, err_msg=name)
    # Resumed at the last step: nothing left to train, the state read back must be identical.
    np.testing.assert_allclose(got["dp2pp2<-pp2"]["losses"], ref, rtol=1e-5)
    np.testing.assert_allclose(got["dp2pp2<-pp2"]["param_norm"], got["pp2"]["param_norm"], rtol=1e-6)
