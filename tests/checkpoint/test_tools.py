"""`ckpt export` and `ckpt inspect` as a user meets them: every state_dict key exported (tied
ones too), provenance recorded, one-line errors that leave nothing behind, quiet in a pipe;
a file that points elsewhere or claims sizes it cannot hold refused by every reader."""

import io
import shutil
import subprocess
import sys
import warnings

import h5py
import pytest
import torch

from hpctrain.checkpoint import CheckpointError, read_model_state
from hpctrain.checkpoint.layout import Entry
from hpctrain.checkpoint.reader import Reader
from hpctrain.checkpoint.resume import resolve_resume
from hpctrain.checkpoint.serial_fallback import FORCE_ENV
from hpctrain.checkpoint.state import write_entries
from hpctrain.checkpoint.tools import export, inspect
from hpctrain.models.registry import build
from tests.checkpoint.forge import FORGERIES, forge
from tests.mpirun import mpi_env, run_single, together

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
    # Independent processes, side by side (one alone leaves a core of two idle).
    procs = together(*(lambda args=args: _ckpt(*args) for args, _ in cases))
    for (args, words), proc in zip(cases, procs):
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


# -- a checkpoint is untrusted input (hpctrain/checkpoint/trust.py) ---------------------------

@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_untrusted_file_refused_by_inspect_export_and_auto(gpt_ckpt, tmp_path, capsys, name):
    # In-process: the tools as the CLI calls them. Before these checks, an absurd shape died
    # in a MemoryError (3.64 TiB) and a dataset elsewhere was read (and exported) silently.
    d = tmp_path / "ck"
    path = forge(str(gpt_ckpt), str(d), name)
    words, head = FORGERIES[name][1], f"checkpoint {path}: "
    assert inspect(path, out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hpctrain: error: {head}") and words in err, err
    assert err.count("\n") == 1, err
    out = tmp_path / "model.h5"
    for load in (lambda: export(path, str(out)), lambda: read_model_state(path),
                 lambda: resolve_resume("auto", str(d))):
        with pytest.raises(CheckpointError) as exc:
            load()
        assert head in str(exc.value) and words in str(exc.value), exc.value
    assert not out.exists()
    # --resume auto said which file it skipped, and why, in one line
    assert capsys.readouterr().err == f"hpctrain: warning: --resume auto skips {head}" \
        f"{err.split(head, 1)[1].rstrip()}; trying the next older checkpoint\n"


def test_compressed_copy_still_loads(gpt_ckpt, tmp_path):
    # What `h5repack -f GZIP=6` makes of a checkpoint: chunked, deflated, its bytes bounded.
    gz = tmp_path / "gz.h5"
    with h5py.File(gpt_ckpt, "r") as src, h5py.File(gz, "w") as dst:
        dst.attrs.update(src.attrs)

        def copy(name, obj):
            if isinstance(obj, h5py.Dataset):
                packed = {"compression": "gzip", "shuffle": True} if obj.ndim else {}
                dst.create_dataset(name, data=obj[()], **packed).attrs.update(obj.attrs)
        src.visititems(copy)
    with h5py.File(gz, "r") as f:
        assert f["model/tok_emb.weight"].compression == "gzip"
    assert inspect(str(gz), out=io.StringIO()) == 0
    want, got = read_model_state(str(gpt_ckpt)), read_model_state(str(gz))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _serial_master(tmp_path, monkeypatch):
    """A serial-fallback checkpoint (a master of virtual datasets over its rank file)."""
    from mpi4py import MPI

    monkeypatch.setenv(FORCE_ENV, "1")
    t = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    path = tmp_path / "ck" / "ckpt-000001.h5"
    path.parent.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "one file per rank" (wanted here)
        write_entries(str(path), [Entry("model/w", (5, 3), torch.float32, t)], {},
                      MPI.COMM_SELF)
    rank_file = next(path.parent.glob("ckpt-000001.h5.parts/*/rank-00000.h5"))
    return path, rank_file, t


def _read_w(path):
    with Reader(str(path)) as r:
        a = r.read("model/w", (5, 3))
        r.check()
    return torch.from_numpy(a)


def _moved_out(path, rank_file):
    away = path.parent.parent / "elsewhere.h5"
    rank_file.rename(away)
    rank_file.symlink_to(away)  # the same bytes, through a link out of the parts directory


def _rank_file_links_out(path, rank_file):
    (path.parent.parent / "other.h5").write_bytes(b"")
    with h5py.File(rank_file, "r+") as f:
        f["junk"] = h5py.ExternalLink(str(path.parent.parent / "other.h5"), "/x")


def _parts_renamed(path, rank_file):
    with h5py.File(path, "r+") as f:
        f.attrs["parts"] = "../" + f.attrs["parts"]


SERIAL_FORGERIES = {
    "rank_file_moved_out": (_moved_out, "' is missing or not a plain file (a symbolic link "
                            "leads elsewhere)"),
    "rank_file_links_out": (_rank_file_links_out, "-00000.h5': 'junk' is an external link to "
                            "'/x' in the file"),
    "parts_renamed": (_parts_renamed, "dataset 'model/w' is a virtual dataset reading "
                      "'model/w' in the file 'ckpt-000001.h5.parts/"),
}


def test_serial_master_reads_its_own_rank_files(tmp_path, monkeypatch):
    path, _, t = _serial_master(tmp_path, monkeypatch)
    assert torch.equal(_read_w(path), t)
    renamed = path.parent / "best.h5"  # a copy under another name still finds its parts
    shutil.copy(path, renamed)
    assert torch.equal(_read_w(renamed), t)


@pytest.mark.parametrize("name", sorted(SERIAL_FORGERIES))
def test_serial_master_refuses_files_elsewhere(tmp_path, monkeypatch, name):
    path, rank_file, _ = _serial_master(tmp_path, monkeypatch)
    change, words = SERIAL_FORGERIES[name]
    change(path, rank_file)
    with pytest.raises(CheckpointError) as exc:
        _read_w(path)
    assert str(exc.value).startswith(f"checkpoint {path}: ") and words in str(exc.value), \
        exc.value


def test_verify_reads_bounded_windows_and_finds_a_late_bad_block(tmp_path, monkeypatch):
    # verify() reads whole checksum blocks a window at a time (not a tensor's share at once).
    from mpi4py import MPI

    from hpctrain.checkpoint import layout, reader

    monkeypatch.setattr(layout, "BLOCK_BYTES", 256)  # 64 float32 per block: 16 blocks
    monkeypatch.setattr(reader, "_VERIFY_BYTES", 512)  # two blocks per read
    path = str(tmp_path / "w.h5")
    t = torch.arange(1000, dtype=torch.float32)
    write_entries(path, [Entry("w", (1000,), torch.float32, t)], {}, MPI.COMM_SELF)
    reads = []
    real = reader.read_flat
    monkeypatch.setattr(reader, "read_flat", lambda d, a, b: reads.append((a, b)) or real(d, a, b))
    with Reader(path) as r:
        assert r.verify("w") is None
    assert reads[0] == (0, 128) and reads[-1] == (896, 1000) and len(reads) == 8
    with h5py.File(path, "r+") as f:
        f["w"][900] = -1.0
    with Reader(path) as r:
        assert "dataset 'w' fails its checksum (blocks [14])" in r.verify("w")
