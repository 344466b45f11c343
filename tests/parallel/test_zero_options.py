"""Trainer options under ZeRO: clipping over shards, fp16 loss scaling, one rank, memory.

The command lines run in one process per world size (tests/parallel/train_worker.py runs
each through hpctrain's CLI code in-process), the memory worker in the same processes; the
one-rank case is a real ``python -m hpctrain train`` under ``mpirun -n 1``."""

import json
import os

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = ["--model", "gpt", "--steps", "12", "--global-batch-size", "12", "--progress", "off",
        "--out-dir", ""]
CLIP = ["--max-grad-norm", "0.5", "--grad-accum", "2"]
ACCUM = ["--grad-accum", "2"]


def _steps(tmp):
    steps = [{"id": "ref-clip", "world": None, "argv": BASE + CLIP},
             {"id": "ref-accum", "world": None, "argv": BASE + ACCUM},
             {"id": "ref", "world": None, "argv": BASE}]
    steps += [{"id": f"clip-{s}", "world": 4, "argv": BASE + CLIP + ["--strategy", s]}
              for s in ("zero1", "zero2", "zero3")]
    steps += [{"id": "ac-zero3", "world": 2,
               "argv": BASE + ACCUM + ["--activation-checkpointing", "--strategy", "zero3"]}]
    steps += [{"id": f"fp16-{s}", "world": 2, "argv": BASE + ["--precision", "fp16",
                                                               "--strategy", s]}
              for s in ("zero1", "zero3")]
    # --reduce-bucket-size: 4 KiB splits every unit into many pieces, 1 TiB holds the model
    steps += [{"id": "bucket-split-zero3", "world": 2,
               "argv": BASE + ACCUM + ["--strategy", "zero3", "--reduce-bucket-size", "4096"]},
              {"id": "bucket-split-zero2", "world": 4,
               "argv": BASE + CLIP + ["--strategy", "zero2", "--reduce-bucket-size", "4096"]},
              {"id": "bucket-whole-zero3", "world": 4,
               "argv": BASE + CLIP + ["--strategy", "zero3", "--reduce-bucket-size",
                                      str(1 << 40)]}]
    # Last in their processes: the memory worker wraps models by hand.
    steps += [{"id": f"memory-{n}", "world": n,
               "script": os.path.join(HERE, "zero_memory_worker.py")} for n in (2, 4)]
    return steps


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


def _summary(results, cid):
    got = results[cid]
    assert got["rc"] == 0, got["stderr"]
    return got["summary"]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_clipping_by_global_norm_over_shards_is_exact(results, strategy):
    ref, got = _summary(results, "ref-clip"), _summary(results, f"clip-{strategy}")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)


def test_zero3_with_activation_checkpointing_is_exact(results):
    # Recomputed block forwards run inside backward, after the block was re-gathered.
    ref, got = _summary(results, "ref-accum"), _summary(results, "ac-zero3")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)


@pytest.mark.parametrize("case, ref", [("bucket-split-zero3", "ref-accum"),
                                       ("bucket-split-zero2", "ref-clip"),
                                       ("bucket-whole-zero3", "ref-clip")])
def test_any_reduce_bucket_size_is_exact(results, case, ref):
    ref, got = _summary(results, ref), _summary(results, case)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_fp16_loss_scaling_tracks_fp32(results, strategy):
    ref, got = _summary(results, "ref"), _summary(results, f"fp16-{strategy}")
    # Low precision changes the arithmetic, not the trajectory: close, and still learning.
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=3e-2)
    assert got["losses"][-1] < got["losses"][0] - 0.3


def test_zero3_one_rank_matches_single(results, tmp_path):
    # A real `python -m hpctrain train` under mpirun (the worker stands for it elsewhere).
    ref = _summary(results, "ref-accum")
    path = tmp_path / "one.json"
    run_mpi(1, ["-m", "hpctrain", "train", *BASE, *ACCUM, "--strategy", "zero3", "--summary",
                str(path)], timeout=240)
    np.testing.assert_allclose(json.loads(path.read_text())["losses"], ref["losses"], rtol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_memory_shrinks_as_the_formulas_say(results, n):
    assert results[f"memory-{n}"]["rc"] == 0  # the worker's assertions abort the launch
