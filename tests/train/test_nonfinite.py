"""The non-finite guard (train.nonfinite, hpctrain/train/nonfinite.py) under every strategy.

A gradient that turns inf while the loss stays finite (tests/fixtures/nonfinite_grad.py), or
``--lr 1e6``: ``stop`` exits with NONFINITE_EXIT_CODE on every rank, naming the step and the
source (the loss, or the first parameter whose gradient is not finite); no checkpoint is
written from that state, the good ones stay and ``--resume auto`` picks the newest. ``skip``
drops at most nonfinite_max_skips steps in a row, then stops; ``ignore`` trains on and
writes no checkpoint of non-finite parameters. fp16: overflows the scaler skips are not guard
events. Few launches, many command lines each (tests/parallel/train_cases.py).
"""

import os
import re

import h5py
import numpy as np
import pytest

from hpctrain.train.nonfinite import NONFINITE_EXIT_CODE
from tests.fixtures.nonfinite_grad import BAD_PARAM
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

GRAD = ["--model", "tests.fixtures.nonfinite_grad:factory"]
BASE = ["--progress", "off", "--out-dir", "", "--optimizer", "adamw", "--lr", "0.01"]
PIPE = ["--strategy", "pipeline", "--mesh", "pp=2,dp=1", "--set", "pipeline.microbatches=4"]
GPT_TP = ["--model", "gpt", "--set", "train.model_options.vocab=68", "--strategy", "tensor",
          "--mesh", "tp=2,dp=1", "--global-batch-size", "8"]
AT3 = {"NONFINITE_GRAD_CALL": "3"}  # one forward per step and rank: step 3
EVERY = {"NONFINITE_GRAD_CALL": "3", "NONFINITE_GRAD_EVERY": "1"}
# a fused optimizer: single's steps are decided on the device and read a step late
# (train/device_step.py); the guard's outcomes must be the synchronous step's
FUSED = ["--set", "train.optimizer_options.fused=true"]

# id: (world, flags, env, the source named: "grad" (BAD_PARAM), "loss", "any" (the loss or
# some parameter's gradient, whichever turns first: --lr 1e6))
STOP = {
    "single": (None, GRAD, AT3, "grad"),
    "single-device": (None, GRAD + FUSED, AT3, "grad"),
    "ddp": (2, GRAD + ["--strategy", "ddp"], AT3, "grad"),
    "zero3": (2, GRAD + ["--strategy", "zero3"], AT3, "grad"),
    "fsdp": (2, GRAD + ["--strategy", "fsdp"], AT3, "grad"),
    # four micro-batches a step, layer 2 on the second stage: its call 9 is in step 3
    "pipeline": (2, GRAD + PIPE, {"NONFINITE_GRAD_CALL": "9"}, "grad"),
    "zero3-clip": (2, GRAD + ["--strategy", "zero3", "--max-grad-norm", "1"], AT3, "grad"),
    "tensor-lr": (2, GPT_TP + ["--lr", "1e6"], {}, "loss"),
    "zero3-lr": (2, ["--model", "mlp", "--strategy", "zero3", "--lr", "1e6"], {}, "any"),
}


def _ckpts(d):
    return sorted(int(n[5:11]) for n in os.listdir(d) if n.startswith("ckpt-")) \
        if os.path.isdir(d) else []


def _finite_params(path):
    with h5py.File(path) as f:
        f.visititems(lambda n, d: isinstance(d, h5py.Dataset) and n.startswith("model/") and
                     np.testing.assert_array_equal(np.isfinite(d[()]), True))


def _steps(tmp):
    steps = []
    for cid, (world, flags, env, _) in STOP.items():
        ck = ["--checkpoint-dir", str(tmp / cid), "--checkpoint-every", "1", "--keep", "2"]
        steps.append({"id": cid, "world": world, "env": env,
                      "argv": BASE + flags + ["--steps", "8"] + ck})
    # the newest good checkpoint resumes (no poisoned call in the steps it trains)
    steps.append({"id": "single-resume", "world": None, "after": ["single"],
                  "env": {"NONFINITE_GRAD_CALL": "100"},
                  "argv": BASE + GRAD + ["--steps", "4", "--checkpoint-dir", str(tmp / "single"),
                                         "--resume", "auto"]})
    # no checkpoint to settle the steps at: the stop is found a step late, and still names 3
    steps.append({"id": "device-lagged", "world": None, "env": AT3,
                  "argv": BASE + GRAD + FUSED + ["--steps", "8", "--max-grad-norm", "1"]})
    more = {
        "skip-device": (None, GRAD + FUSED + ["--nonfinite", "skip"], AT3),
        "skip-device-over": (None, GRAD + FUSED + ["--nonfinite", "skip", "--set",
                                                   "train.nonfinite_max_skips=2"], EVERY),
        "skip-zero3": (2, GRAD + ["--strategy", "zero3", "--nonfinite", "skip"], AT3),
        "skip-ddp": (2, GRAD + ["--strategy", "ddp", "--nonfinite", "skip"], AT3),
        "skip-pipeline-over": (2, GRAD + PIPE + ["--nonfinite", "skip", "--set",
                                                 "train.nonfinite_max_skips=2"],
                               {"NONFINITE_GRAD_CALL": "9", "NONFINITE_GRAD_EVERY": "1"}),
        "skip-fsdp-over": (2, GRAD + ["--strategy", "fsdp", "--nonfinite", "skip", "--set",
                                      "train.nonfinite_max_skips=2"], EVERY),
        "ignore-lr": (None, ["--model", "mlp", "--lr", "1e6", "--nonfinite", "ignore"], {}),
        "fp16-overflow": (None, GRAD + ["--precision", "fp16"], AT3),
        "fp16-collapse": (None, GRAD + ["--precision", "fp16", "--steps", "24",
                                          "--checkpoint-every", "4"], EVERY),
    }
    for cid, (world, flags, env) in more.items():
        ck = ["--checkpoint-dir", str(tmp / cid), "--checkpoint-every", "1", "--keep", "0"]
        steps.append({"id": cid, "world": world, "env": env,
                      "argv": BASE + ["--steps", "8"] + ck + flags})
    return steps


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return res["_tmp"], res


@pytest.mark.parametrize("cid", list(STOP))
def test_stop_names_the_step_and_source_and_writes_no_checkpoint(results, cid):
    tmp, got = results
    r = got[cid]
    assert r["rc"] == NONFINITE_EXIT_CODE, r["stdout"] + r["stderr"]
    assert "Traceback" not in r["stderr"]
    kind = STOP[cid][3]
    pattern = {"grad": rf"step (\d+): gradient of '{re.escape(BAD_PARAM)}' is not finite \(grad "
                       rf"norm (inf|nan)",
               "loss": r"step (\d+): the loss is (nan|inf)",
               "any": r"step (\d+): (the loss is (nan|inf)|gradient of '[\w.]+' is not finite "
                      r"\(grad norm (inf|nan))"}[kind]
    m = re.search(r"hpctrain: error: " + pattern, r["stderr"])
    assert m, r["stderr"]
    bad = int(m.group(1))
    if kind == "grad":
        assert bad == 3
    written = _ckpts(tmp / cid)
    if cid == "single":  # single-resume went on from its step 2 and wrote step 4
        written.remove(4)
    assert written == [s for s in range(max(1, bad - 2), bad)], (bad, written)
    assert "stopped without writing a checkpoint (the newest good one is " + (
        str(tmp / cid / f"ckpt-{bad - 1:06d}.h5") if bad > 1 else "none") in r["stderr"]
    for s in written:
        _finite_params(tmp / cid / f"ckpt-{s:06d}.h5")


def test_device_steps_stop_a_step_late_naming_the_bad_step(results):
    r = results[1]["device-lagged"]
    assert r["rc"] == NONFINITE_EXIT_CODE, r["stdout"] + r["stderr"]
    assert re.search(rf"hpctrain: error: step 3: gradient of '{re.escape(BAD_PARAM)}' is not "
                     rf"finite \(grad norm (inf|nan)", r["stderr"]), r["stderr"]


def test_resume_picks_the_newest_good_checkpoint(results):
    tmp, got = results
    r = got["single-resume"]
    assert r["rc"] == 0, r["stdout"] + r["stderr"]
    assert f"resumed from {tmp / 'single' / 'ckpt-000002.h5'} at step 2" in r["stdout"]


def test_skip_drops_the_step_and_trains_on(results):
    tmp, got = results
    for cid in ("skip-zero3", "skip-ddp", "skip-device"):
        r = got[cid]
        assert r["rc"] == 0, r["stdout"] + r["stderr"]
        assert re.search(rf"step 3: gradient of '{re.escape(BAD_PARAM)}' is not finite .*; step "
                         rf"skipped .*1 of at most 3 in a row", r["stdout"]), r["stdout"]
        assert r["stdout"].count("step skipped") == 1
        assert np.isfinite(r["summary"]["param_norm"])
        assert r["summary"]["nonfinite_skipped_steps"] == 1
        assert _ckpts(tmp / cid) == list(range(1, 9))


def test_skip_stops_after_max_skips_in_a_row(results):
    tmp, got = results
    for cid in ("skip-pipeline-over", "skip-fsdp-over", "skip-device-over"):
        r = got[cid]
        assert r["rc"] == NONFINITE_EXIT_CODE, r["stdout"] + r["stderr"]
        assert r["stdout"].count("step skipped") == 2, r["stdout"]
        assert re.search(rf"hpctrain: error: step 5: gradient of '{re.escape(BAD_PARAM)}' is not "
                         rf"finite .*stopped after 2 skipped steps in a row", r["stderr"]), \
            r["stderr"]
        assert _ckpts(tmp / cid) == [1, 2, 3, 4]  # skipped steps leave the parameters as they were
        for s in (3, 4):
            _finite_params(tmp / cid / f"ckpt-{s:06d}.h5")


def test_ignore_trains_on_and_never_saves_nonfinite_parameters(results):
    tmp, got = results
    r = got["ignore-lr"]
    assert r["rc"] == 0, r["stdout"] + r["stderr"]
    assert "no checkpoint written (train.nonfinite = ignore)" in r["stdout"]
    written = _ckpts(tmp / "ignore-lr")
    assert len(written) < 8
    for s in written:
        _finite_params(tmp / "ignore-lr" / f"ckpt-{s:06d}.h5")


def test_fp16_overflows_are_the_scalers_until_the_scale_collapses(results):
    tmp, got = results
    r = got["fp16-overflow"]
    assert r["rc"] == 0 and "skipped" not in r["stdout"], r["stdout"] + r["stderr"]
    r = got["fp16-collapse"]
    assert r["rc"] == NONFINITE_EXIT_CODE, r["stdout"] + r["stderr"]
    m = re.search(rf"hpctrain: error: step (\d+): gradient of '{re.escape(BAD_PARAM)}' is not "
                  rf"finite \(grad norm \w+, fp16 loss scale \S+ < 1", r["stderr"])
    assert m, r["stderr"]
    for s in _ckpts(tmp / "fp16-collapse"):
        assert s < int(m.group(1))
        _finite_params(tmp / "fp16-collapse" / f"ckpt-{s:06d}.h5")
