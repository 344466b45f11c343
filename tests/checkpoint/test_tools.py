"""`ckpt export` and `ckpt inspect` as a user meets them: every state_dict key exported (tied
ones too), provenance recorded, one-line errors that leave nothing behind, quiet in a pipe."""

import subprocess
import sys

import h5py
import pytest
import torch

from hpctrain.checkpoint import read_model_state
from hpctrain.models.registry import build
from tests.mpirun import mpi_env, run_single

pytestmark = pytest.mark.mpi


def _ckpt(*args, check=False):
    return run_single(["-m", "hpctrain", "ckpt", *map(str, args)], check=check, timeout=120)


def test_export_has_every_key_and_loads_strict(gpt_ckpt, tmp_path):
    out = tmp_path / "model.h5"
    proc = _ckpt("export", gpt_ckpt, out, check=True)
    assert "exported" in proc.stdout
    model = build("gpt", 0).model
    assert model.head.weight is model.tok_emb.weight  # tied: two keys, one tensor
    state = read_model_state(str(out))
    assert set(state) == set(model.state_dict())
    model.load_state_dict(state, strict=True)  # no "Missing key(s): head.weight"
    trained = read_model_state(str(gpt_ckpt))  # the checkpoint itself, aliases resolved
    assert set(trained) == set(state)
    for k, t in model.state_dict().items():
        assert torch.equal(t, trained[k]), k
    with h5py.File(out) as f:
        assert "model/head.weight" in f and "optim" not in f
        a = f.attrs
        assert (a["source_strategy"], int(a["source_world_size"]), int(a["step"])) == \
            ("single", 1, 2)
        assert a["source_path"] == str(gpt_ckpt) and "strategy" not in a
        assert '"head.weight": "tok_emb.weight"' in a["model_aliases"]
    listing = _ckpt("inspect", out, check=True).stdout
    assert f"model export of {gpt_ckpt} (step 2, written by strategy single at world size 1)" \
        in listing and "checksums: all ok; metadata: ok" in listing


def test_export_errors_are_one_line_and_leave_nothing(gpt_ckpt, tmp_path):
    target = tmp_path / "some" / "dir"
    target.mkdir(parents=True)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not an HDF5 file\n" * 10)
    cases = [(("export", gpt_ckpt, target), f"{str(target)!r} is a directory"),
             (("export", garbage, tmp_path / "m.h5"), "cannot open checkpoint"),
             (("export", gpt_ckpt, tmp_path / "nodir" / "m.h5"), "does not exist"),
             (("inspect", garbage), "cannot open checkpoint")]
    for args, words in cases:
        proc = _ckpt(*args)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stderr.startswith("hpctrain: error: ") and words in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "garbage.h5", "some"]


def test_inspect_into_closed_pipe_is_quiet(gpt_ckpt):
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "ckpt", "inspect", str(gpt_ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=mpi_env())
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
