"""Parallel HDF5 checkpoints under real mpirun: resume, reshard, crash, corruption, fallback.

Resume, reshard and the serial fallback run their command lines many per process, in the
session's pool (tests/parallel/train_cases.py: one launch per world size shared with the
other pooled modules; a checkpoint written at one world size is resumed in a later launch at
another), and so do the plain runs that write the checkpoints the other tests damage.
Crashes, corrupt files and errors, whose exit codes and error lines are the point, run as
real ``python -m hpctrain`` launches."""

import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from tests.checkpoint.forge import FORGERIES
from tests.mpirun import run_mpi, run_single, together
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

FORGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forge.py")

# A global batch of 12 is valid at 1, 2, 3 and 4 ranks.
COMMON = ["-m", "hpctrain", "train", "--model", "mlp", "--global-batch-size", "12",
          "--weight-decay", "0.01", "--progress", "off", "--out-dir", ""]
OPTS = {"sgd": ["--optimizer", "sgd", "--lr", "0.1", "--set", "train.momentum=0.9"],
        "adamw": ["--optimizer", "adamw", "--lr", "0.003"]}


def _run(world, strategy, opt, steps, summary, extra=(), env=None, check=True):
    args = COMMON + OPTS[opt] + ["--steps", str(steps), "--strategy", strategy,
                                 "--summary", str(summary)] + list(extra)
    if strategy == "single":
        return run_single(args, env=env, check=check, timeout=240)
    return run_mpi(world, args, env=env, check=check, timeout=240)


def _losses(path):
    return json.loads(path.read_text())["losses"]


# (strategy, world) before -> after, optimizer
RESUME = [(("single", 1), ("single", 1), "sgd"), (("single", 1), ("single", 1), "adamw"),
          (("ddp", 2), ("ddp", 2), "sgd"), (("ddp", 2), ("ddp", 2), "adamw")]
RESHARD = [(("ddp", 4), ("ddp", 2), "adamw"), (("ddp", 2), ("ddp", 4), "adamw"),
           (("ddp", 4), ("ddp", 1), "sgd"), (("single", 1), ("ddp", 4), "adamw"),
           (("ddp", 3), ("ddp", 2), "adamw"), (("ddp", 2), ("single", 1), "sgd")]


SERIAL = [(2, 2), (2, 3)]  # (write world, read world): per-rank files and a virtual master
FORCE_SERIAL = {"HPCTRAIN_CKPT_FORCE_SERIAL": "1"}


# The runs before a real CLI launch whose exit code and error lines are checked:
# name -> (world, strategy, optimizer, steps, flags with {d} the checkpoint directory).
CRASH_FLAGS = ["--checkpoint-dir", "{d}", "--checkpoint-every", "5", "--keep", "2"]
SKIPS_FLAGS = ["--checkpoint-dir", "{d}", "--checkpoint-every", "3", "--keep", "0"]
PREP = {
    "crash-straight": (2, "ddp", "adamw", 10, []),
    "crash": (2, "ddp", "adamw", 5, CRASH_FLAGS),
    "corrupt": (2, "ddp", "adamw", 3, ["--checkpoint-dir", "{d}"]),
    "skips": (2, "ddp", "adamw", 6, SKIPS_FLAGS),
    "wrong-shape": (1, "single", "sgd", 2, ["--checkpoint-dir", "{d}"]),
    "h5ls": (2, "ddp", "adamw", 6, ["--checkpoint-dir", "{d}", "--checkpoint-every", "2",
                                    "--keep", "2"]),
}

# A checkpoint of another model (another size, a layer more or less) resumed under each
# flavour: refused with one line on every rank, with --resume auto and FILE, in-process in
# the launches above. id -> (world, flags, model options, resume, the error's words); "{f}"
# is the "wrong-shape" checkpoint (mlp: hidden 83, 3 layers; sgd), "{g}" a GPT's (d_model 48).
SHAPE = "dataset 'model/stem.weight' has shape (83, 37), the model expects (50, 37)"
EXTRA = "dataset 'model/blocks.2.fc.bias' is not a tensor of the model"
MISSING = "dataset 'model/blocks.3.fc.weight' is missing (a tensor of the model)"
GPT_ARGS = ["--model", "gpt", "--global-batch-size", "8", "--optimizer", "adamw", "--lr",
            "0.003", "--progress", "off", "--out-dir", ""]
MISFIT = {
    "misfit-single-file": (1, ["--strategy", "single"], "{layers=2}", "{f}", EXTRA),
    "misfit-ddp-auto": (2, ["--strategy", "ddp"], "{hidden=50}", "auto", SHAPE),
    "misfit-zero1-file": (2, ["--strategy", "zero1"], "{hidden=50}", "{f}", SHAPE),
    "misfit-zero2-auto": (2, ["--strategy", "zero2"], "{layers=2}", "auto", EXTRA),
    "misfit-zero3-auto": (2, ["--strategy", "zero3"], "{hidden=50}", "auto", SHAPE),
    "misfit-fsdp-file": (2, ["--strategy", "fsdp"], "{hidden=50}", "{f}", SHAPE),
    "misfit-fsdp-auto": (2, ["--strategy", "fsdp"], "{layers=4}", "auto", MISSING),
    "misfit-pp-zero1-file": (2, ["--strategy", "pipeline", "--mesh", "pp=2", "--dp-flavour",
                                 "zero1"], "{hidden=50}", "{f}", SHAPE),
    "misfit-tensor-file": (2, ["--strategy", "tensor"], "{d_model=64}", "{g}",
                           "dataset 'model/tok_emb.weight' has shape (67, 48), the model "
                           "expects (67, 64)"),
}


def _misfit_steps(tmp):
    """The GPT checkpoint's run, then every MISFIT case."""
    g = tmp / "misfit-gpt" / "ck"
    steps = [{"id": "misfit-gpt", "world": None,
              "argv": GPT_ARGS + ["--steps", "1", "--checkpoint-dir", str(g)]}]
    d = tmp / "wrong-shape" / "ck"
    for cid, (world, flags, options, how, _) in MISFIT.items():
        gpt = "tensor" in cid
        resume = ["--checkpoint-dir", str(d), "--resume", "auto"] if how == "auto" else \
            ["--resume", how.format(f=d / "ckpt-000002.h5", g=g / "ckpt-000001.h5")]
        argv = (GPT_ARGS if gpt else COMMON[3:] + OPTS["sgd"]) + ["--steps", "4", *flags,
                                                                   "--set",
                                                                   f"train.model_options={options}",
                                                                   *resume]
        steps.append({"id": cid, "world": _where(flags[1], world), "argv": argv,
                      "after": ["misfit-gpt" if gpt else "wrong-shape"]})
    return steps


def _ident(c):
    return f"{c[0][0]}{c[0][1]}-{c[1][0]}{c[1][1]}-{c[2]}"


def _train_args(strategy, opt, steps, extra=()):
    return COMMON + OPTS[opt] + ["--steps", str(steps), "--strategy", strategy] + list(extra)


def _where(strategy, world):
    return None if strategy == "single" else world  # single: a plain process, as _run does


def _steps(tmp):
    """For every RESUME and RESHARD case: the straight 20-step run, the 10-step run that
    checkpoints, and the run that resumes it (a checkpoint directory per case); the same
    for the SERIAL round trips (8 steps, the checkpoint written in per-rank files); the
    PREP runs that the real CLI launches below start from; the untrusted file and every
    MISFIT case. A straight run waits for its cases' writes: it runs in their resumes'
    launch, not in one of its own."""
    steps, straight = [], {}
    for before, after, opt in RESUME + RESHARD:
        key = (after, opt)
        if key not in straight:  # the same command line: run once
            straight[key] = {"id": f"straight-{after[0]}{after[1]}-{opt}",
                             "world": _where(*after), "argv": _train_args(after[0], opt, 20),
                             "after": []}
            steps.append(straight[key])
    for case in RESUME + RESHARD:
        before, after, opt = case
        d = tmp / _ident(case) / "ck"
        steps.append({"id": f"{_ident(case)}-a", "world": _where(*before),
                      "argv": _train_args(before[0], opt, 10,
                                          ["--checkpoint-dir", str(d)])})
        steps.append({"id": f"{_ident(case)}-b", "world": _where(*after),
                      "after": [f"{_ident(case)}-a"],
                      "argv": _train_args(after[0], opt, 20,
                                          ["--checkpoint-dir", str(d), "--resume", "auto"])})
        straight[(after, opt)]["after"].append(f"{_ident(case)}-a")
    for worlds in SERIAL:  # test_serial_fallback_round_trips
        d, name = tmp / f"serial-{worlds}" / "ck", f"serial-{worlds[0]}-{worlds[1]}"
        steps.append({"id": f"{name}-straight", "world": worlds[1], "after": [f"{name}-a"],
                      "argv": _train_args("ddp", "adamw", 8)})
        steps.append({"id": f"{name}-a", "world": worlds[0], "env": FORCE_SERIAL,
                      "argv": _train_args("ddp", "adamw", 4, ["--checkpoint-dir", str(d)])})
        steps.append({"id": f"{name}-b", "world": worlds[1], "after": [f"{name}-a"],
                      "argv": _train_args("ddp", "adamw", 8,
                                          ["--checkpoint-dir", str(d), "--resume", "auto"])})
    for name, (world, strategy, opt, n, flags) in PREP.items():
        flags = [f.format(d=tmp / name / "ck") for f in flags]
        steps.append({"id": name, "world": _where(strategy, world),
                      "argv": _train_args(strategy, opt, n, flags)})
    steps += _misfit_steps(tmp)
    # A file that reads another file's data (forge.py, run after the misfit GPT's run wrote
    # the checkpoint it forges) named by --resume under zero3.
    gpt = tmp / "misfit-gpt" / "ck" / "ckpt-000001.h5"
    steps.append({"id": "forge", "world": None, "script": FORGE, "after": ["misfit-gpt"],
                  "args": [str(gpt), str(tmp / "untrusted"), "virtual_elsewhere"]})
    steps.append({"id": "untrusted-zero3", "world": 2, "after": ["forge"],
                  "argv": ["--model", "gpt", "--strategy", "zero3", "--steps", "4",
                           "--optimizer", "adamw", "--lr", "0.003", "--global-batch-size", "8",
                           "--progress", "off", "--out-dir", "", "--resume",
                           str(tmp / "untrusted" / gpt.name)]})
    return steps


pool(__name__, _steps, "resumed")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The pooled runs of ``_steps``, by test: each RESUME and RESHARD case (its checkpoint
    directory, write, resume and straight run), each SERIAL round trip, each PREP run, the
    untrusted file's run and each MISFIT run."""
    results = pooled_results(__name__, tmp_path_factory)
    tmp = results["_tmp"]
    out = {case: (tmp / _ident(case) / "ck", results[f"{_ident(case)}-a"],
                  results[f"{_ident(case)}-b"],
                  results[f"straight-{case[1][0]}{case[1][1]}-{case[2]}"])
           for case in RESUME + RESHARD}
    for worlds in SERIAL:
        name = f"serial-{worlds[0]}-{worlds[1]}"
        out[worlds] = (tmp / f"serial-{worlds}" / "ck",
                       *(results[f"{name}-{k}"] for k in ("a", "b", "straight")))
    for name in PREP:
        assert results[name]["rc"] == 0, results[name]["stderr"]
        out[name] = (tmp / name / "ck", results[name]["summary"])
    out["untrusted"] = (str(tmp / "untrusted" / "ckpt-000001.h5"), results["untrusted-zero3"])
    assert results["misfit-gpt"]["rc"] == 0, results["misfit-gpt"]["stderr"]
    out.update({cid: (tmp, results[cid]) for cid in MISFIT})
    return out


def _resume_case(resumed, case, rtol):
    d, a, got, ref = resumed[case]
    assert a["rc"] == 0 and got["rc"] == 0 and ref["rc"] == 0, a["stderr"] + got["stderr"]
    assert (d / "ckpt-000010.h5").exists()
    assert f"checkpoint written: {d / 'ckpt-000010.h5'}" in a["stdout"]
    got, ref = got["summary"]["losses"], ref["summary"]["losses"]
    assert len(got) == 20
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=0)


@pytest.mark.parametrize("case", RESUME, ids=_ident)
def test_resume_continues_trajectory(resumed, case):
    _resume_case(resumed, case, rtol=1e-6)


@pytest.mark.parametrize("case", RESHARD, ids=_ident)
def test_reshard_continues_trajectory(resumed, case):
    # Different world sizes sum gradients in a different order: the ddp-equivalence tolerance.
    _resume_case(resumed, case, rtol=1e-5)


def test_crash_during_save_keeps_previous(resumed, tmp_path):
    d, _ = resumed["crash"]
    flags = [f.format(d=d) for f in CRASH_FLAGS]
    straight = resumed["crash-straight"][1]["losses"]
    proc = _run(2, "ddp", "adamw", 10, tmp_path / "b.json", flags + ["--resume", "auto"],
                env={"HPCTRAIN_CKPT_FAULT": "1:3"}, check=False)
    assert proc.returncode != 0
    assert (d / "ckpt-000005.h5").exists() and not (d / "ckpt-000010.h5").exists()
    assert (d / "ckpt-000010.h5.tmp").exists()  # the dead save's; no live save holds it
    proc = _run(2, "ddp", "adamw", 10, tmp_path / "c.json", flags + ["--resume", "auto"])
    assert "resumed from" in proc.stdout and "ckpt-000005.h5" in proc.stdout
    assert f"removed {d / 'ckpt-000010.h5.tmp'}" in proc.stderr
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-000005.h5", "ckpt-000010.h5", "latest"]
    np.testing.assert_allclose(_losses(tmp_path / "c.json"), straight, rtol=1e-6)


def test_corrupt_dataset_named_once_for_every_rank(resumed, tmp_path):
    d, _ = resumed["corrupt"]
    with h5py.File(d / "ckpt-000003.h5", "r+") as f:
        w = f["model/stem.weight"]
        w[0, 0] = w[0, 0] + 1.0  # the data changes, its checksum attribute does not
    proc = _run(2, "ddp", "adamw", 6, tmp_path / "b.json",
                ["--checkpoint-dir", str(d), "--resume", "auto"], check=False)
    # Every rank agreed on the error: rank 0 says it once, every rank exits 1, no traceback.
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpctrain: error:")]
    assert len(errors) == 1 and "'model/stem.weight'" in errors[0] and "checksum" in errors[0], \
        proc.stderr
    assert "Traceback" not in proc.stderr


def test_auto_resume_skips_corrupt_newest(resumed, tmp_path):
    # A requeued job whose newest checkpoint is damaged goes on from the one before it.
    d, a = resumed["skips"]
    flags = [f.format(d=d) for f in SKIPS_FLAGS]
    with h5py.File(d / "ckpt-000006.h5", "r+") as f:
        f["optim/stem.weight/exp_avg"][0, 0] += 1.0
    # An older copy of step 3 under the name of step 9: auto goes by the saved step, and
    # among files of one step by the last written, not by the name.
    shutil.copyfile(d / "ckpt-000003.h5", d / "ckpt-000009.h5")
    older = os.stat(d / "ckpt-000003.h5").st_mtime - 60
    os.utime(d / "ckpt-000009.h5", (older, older))
    proc = _run(2, "ddp", "adamw", 6, tmp_path / "b.json", flags + ["--resume", "auto"])
    assert proc.stderr.count(f"--resume auto skips checkpoint {d / 'ckpt-000006.h5'}: dataset "
                             f"'optim/stem.weight/exp_avg' fails its checksum") == 1
    assert proc.stdout.count("--resume auto picked") == 1
    assert (f"hpctrain: --resume auto picked {d / 'ckpt-000003.h5'}: step 3, the highest step "
            f"in {d} that verifies; of the 2 files at that step, the last written\n") in proc.stdout
    assert f"resumed from {d / 'ckpt-000003.h5'} at step 3" in proc.stdout
    np.testing.assert_allclose(_losses(tmp_path / "b.json"), a["losses"], rtol=1e-6)
    # Named explicitly, a damaged file still stops the run.
    with h5py.File(d / "ckpt-000006.h5", "r+") as f:
        f["model/stem.weight"][0, 0] += 1.0
    proc = _run(2, "ddp", "adamw", 8, tmp_path / "c.json",
                flags + ["--resume", str(d / "ckpt-000006.h5")], check=False)
    assert proc.returncode != 0 and "'model/stem.weight' fails its checksum" in proc.stderr


def test_disk_full_fails_every_rank_and_leaves_nothing(tmp_path):
    d = tmp_path / "ck"
    proc = _run(2, "ddp", "adamw", 2, tmp_path / "a.json", ["--checkpoint-dir", str(d)],
                env={"HPCTRAIN_CKPT_FAULT": "1:3:enospc"}, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("hpctrain: error: ") == 1, proc.stderr
    assert (f"hpctrain: error: checkpoint write to {d / 'ckpt-000002.h5'} failed: "
            f"no space left on device (needed ~") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and os.listdir(d) == []


@pytest.mark.parametrize("cid", MISFIT)
def test_other_model_refused_in_one_line(resumed, cid):
    tmp, got = resumed[cid]
    _, flags, _, how, words = MISFIT[cid]
    path = tmp / ("misfit-gpt/ck/ckpt-000001.h5" if "tensor" in cid else
                  "wrong-shape/ck/ckpt-000002.h5")
    errors = [ln for ln in got["stderr"].splitlines() if ln.startswith("hpctrain: error:")]
    # One line, the same on every rank (ranks that differ are named; a rank that did not
    # raise aborts the launch), exit 1 as for every other resume error.
    assert got["rc"] == 1 and len(errors) == 1, got["stderr"]
    assert errors[0].startswith(f"hpctrain: error: checkpoint {path}: {words}; resume with the "
                                f"config the checkpoint was written with"), errors[0]
    assert "Traceback" not in got["stderr"]
    if how == "auto":
        assert f"--resume auto picked {path}: step 2" in got["stdout"], got["stdout"]


def test_wrong_shape_named(resumed, tmp_path):
    # The case through the real command line: zero3, --resume FILE.
    d, _ = resumed["wrong-shape"]
    path = d / "ckpt-000002.h5"
    proc = _run(2, "zero3", "sgd", 4, tmp_path / "b.json",
                ["--resume", str(path), "--set", "train.model_options={hidden=50}"], check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("hpctrain: error: ") == 1 and "Traceback" not in proc.stderr
    assert f"hpctrain: error: checkpoint {path}: {SHAPE}; resume with the config" in proc.stderr
    assert "MPI_ABORT" not in proc.stderr + proc.stdout


def test_untrusted_resume_file_refused_under_zero3(resumed):
    # Every rank refuses it before loading anything: one error line, exit 1, no traceback.
    path, run = resumed["untrusted"]
    assert run["rc"] == 1 and run["summary"] is None, run["stderr"]
    errors = [ln for ln in run["stderr"].splitlines() if ln.startswith("hpctrain: error:")]
    assert len(errors) == 1 and f"checkpoint {path}: {FORGERIES['virtual_elsewhere'][1]}" \
        in errors[0], run["stderr"]
    assert "Traceback" not in run["stderr"]


@pytest.mark.parametrize("worlds", SERIAL)
def test_serial_fallback_round_trips(resumed, worlds):
    d, a, b, straight = resumed[worlds]
    for run in (a, b, straight):
        assert run["rc"] == 0, run["stderr"]
    assert "one file per rank" in a["stderr"]
    assert (d / "ckpt-000004.h5.parts").is_dir()
    with h5py.File(d / "ckpt-000004.h5") as f:
        assert f.attrs["layout"] == "virtual" and f["model/stem.weight"].is_virtual
    np.testing.assert_allclose(b["summary"]["losses"], straight["summary"]["losses"], rtol=1e-5)


def test_h5ls_inspect_export_keep(resumed, tmp_path):
    d, _ = resumed["h5ls"]
    names = sorted(p.name for p in d.iterdir())
    assert names == ["ckpt-000004.h5", "ckpt-000006.h5", "latest"]
    assert (d / "latest").read_text().strip() == "ckpt-000006.h5"
    ls = subprocess.run(["h5ls", "-r", str(d / "ckpt-000006.h5")], capture_output=True,
                        text=True, check=True).stdout
    assert "/model/stem.weight" in ls and "{83, 37}" in ls and "/optim/stem.weight/exp_avg" in ls
    # inspect, export, and inspect of a damaged copy: independent processes, side by side
    # (one alone leaves a core of two idle).
    damaged = tmp_path / "damaged" / "ckpt-000006.h5"
    damaged.parent.mkdir()
    shutil.copyfile(d / "ckpt-000006.h5", damaged)
    with h5py.File(damaged, "r+") as f:
        f["optim/head.bias/exp_avg"][0] += 1.0
    exp = tmp_path / "model.h5"
    ckpt = ["-m", "hpctrain", "ckpt"]
    out, _, proc = together(
        lambda: run_single(ckpt + ["inspect", str(d / "ckpt-000006.h5")]).stdout,
        lambda: run_single(ckpt + ["export", str(d / "ckpt-000006.h5"), str(exp)]),
        lambda: run_single(ckpt + ["inspect", str(damaged)], check=False))
    assert "step 6" in out and "world size 2" in out and "checksums: all ok" in out
    with h5py.File(exp) as f:
        assert "optim" not in f and f["model/stem.weight"].shape == (83, 37)
    assert proc.returncode == 1 and "optim/head.bias/exp_avg" in proc.stderr


def test_prune_keeps_the_file_just_written(tmp_path):
    from hpctrain.checkpoint import manager

    for name in ("ckpt-000010.h5", "ckpt-000099.h5"):  # 99: an old file renamed by hand
        (tmp_path / name).write_bytes(b"x")
    assert manager.prune(str(tmp_path), 1, str(tmp_path / "ckpt-000010.h5")) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000010.h5", "ckpt-000099.h5"]
    (tmp_path / "ckpt-000020.h5").write_bytes(b"x")
    assert manager.prune(str(tmp_path), 1, str(tmp_path / "ckpt-000020.h5")) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000020.h5", "ckpt-000099.h5"]
