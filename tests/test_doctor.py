"""The doctor: each check's verdict and fix, the report's layout, and per-rank output."""

import io
import sys

import pytest

from hpctrain import doctor
from hpctrain.doctor import (CHECK_NAMES, H5PY_FIX, HOROVOD_FIX, MPI_FIX, Check, collect,
                             format_report, run_doctor)
from tests.mpirun import run_mpi

ALL_CHECKS = ["check_python", "check_torch", "check_cuda", "check_launcher", "check_mpi",
              "check_horovod", "check_h5py"]
REAL = {func: getattr(doctor, func) for func in ALL_CHECKS}


@pytest.fixture
def all_ok(monkeypatch):
    """Replace every check with a fast passing fake; return the monkeypatch to override some."""
    for func, name in zip(ALL_CHECKS, CHECK_NAMES):
        monkeypatch.setattr(doctor, func, lambda env, name=name: Check(name, True, f"{name} fine"))
    return monkeypatch


def test_collect_returns_every_check_in_order():
    # Real checks: must hold whether or not Horovod/h5py are installed yet.
    checks = collect({})
    assert [c.name for c in checks] == list(CHECK_NAMES)
    for c in checks:
        assert isinstance(c, Check) and c.detail
        assert c.ok or c.fix, f"{c.name} fails without a fix"


def test_run_doctor_all_ok(all_ok):
    out = io.StringIO()
    assert run_doctor({}, out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == len(CHECK_NAMES) + 1
    assert all(line.startswith("OK    ") for line in lines[:-1])
    assert lines[-1] == f"doctor: all {len(CHECK_NAMES)} checks passed"


def test_horovod_not_installed(all_ok):
    # None in sys.modules makes `import horovod` raise ImportError, as when it is missing.
    all_ok.setattr(doctor, "check_horovod", REAL["check_horovod"])
    all_ok.setitem(sys.modules, "horovod", None)
    all_ok.setitem(sys.modules, "horovod.torch", None)
    out = io.StringIO()
    assert run_doctor({}, out) == 1
    text = out.getvalue()
    assert "FAIL  horovod" in text
    assert f"fix: {HOROVOD_FIX}" in text
    assert "make setup" in text and "HOROVOD_WITH_MPI=1" in text
    assert text.splitlines()[-1] == f"doctor: 1 of {len(CHECK_NAMES)} checks failed (horovod)"


def test_horovod_built_without_mpi(monkeypatch):
    fake = type(sys)("horovod")
    fake.__version__ = "0.28.1"
    fake_torch = type(sys)("horovod.torch")
    fake_torch.mpi_built = lambda: False
    fake_torch.gloo_built = lambda: True
    fake_torch.nccl_built = lambda: 0
    fake.torch = fake_torch
    monkeypatch.setitem(sys.modules, "horovod", fake)
    monkeypatch.setitem(sys.modules, "horovod.torch", fake_torch)
    check = doctor.check_horovod({})
    assert not check.ok
    assert "mpi=no" in check.detail and "built without MPI" in check.detail
    assert check.fix == HOROVOD_FIX


def test_h5py_missing_or_serial(monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    check = doctor.check_h5py({})
    assert not check.ok and check.fix == H5PY_FIX
    assert "HDF5_MPI=ON" in check.fix and "--no-binary=h5py" in check.fix

    fake = type(sys)("h5py")
    fake.get_config = lambda: type("Cfg", (), {"mpi": False})()
    fake.version = type("V", (), {"version": "3.16.0", "hdf5_version": "1.14.4"})
    monkeypatch.setitem(sys.modules, "h5py", fake)
    check = doctor.check_h5py({})
    assert not check.ok and "mpi=no" in check.detail and check.fix == H5PY_FIX

    fake.get_config = lambda: type("Cfg", (), {"mpi": True})()
    check = doctor.check_h5py({})
    assert check.ok and check.fix is None and "HDF5 1.14.4" in check.detail


def test_mpi_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    check = doctor.check_mpi({})
    assert not check.ok and check.fix == MPI_FIX
    assert "apt-get install openmpi-bin libopenmpi-dev" in check.fix


def test_mpi_world_must_match_launcher():
    pytest.importorskip("mpi4py")
    # This process is an MPI singleton (size 1); an environment claiming 4 ranks means
    # mpi4py and the launcher do not talk to each other.
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    check = doctor.check_mpi(env)
    assert not check.ok
    assert "rank 0/1" in check.detail and "openmpi launched rank 0/4" in check.detail
    assert "--no-binary=mpi4py" in check.fix
    assert doctor.check_mpi({}).ok


def test_launcher_malformed():
    check = doctor.check_launcher({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"})
    assert not check.ok and "OMPI_COMM_WORLD_RANK='x'" in check.detail and check.fix


def test_cuda_forced_without_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check = doctor.check_cuda({"HPCTRAIN_DEVICE": "cuda"})
    assert not check.ok and "HPCTRAIN_DEVICE='cuda'" in check.detail
    assert "HPCTRAIN_DEVICE=cpu" in check.fix
    assert doctor.check_cuda({}).ok


def test_format_rank0_table_is_aligned():
    checks = [Check("python", True, "3.11"), Check("horovod", False, "not importable", "do X"),
              Check("mpi", True, "Open MPI v4.1.4")]
    assert format_report(checks, 0) == (
        "OK    python   3.11\n"
        "FAIL  horovod  not importable\n"
        "               fix: do X\n"
        "OK    mpi      Open MPI v4.1.4\n"
        "doctor: 1 of 3 checks failed (horovod)\n")


def test_format_other_ranks_print_only_their_failures():
    ok = [Check("python", True, "3.11"), Check("mpi", True, "fine")]
    assert format_report(ok, 3) == ""
    text = format_report(ok + [Check("h5py", False, "mpi=no", "rebuild")], 3)
    lines = text.splitlines()
    # Same columns as rank 0's table (names padded to the longest, "python").
    assert lines == ["[rank 3] FAIL  h5py    mpi=no", "[rank 3] " + " " * 14 + "fix: rebuild"]


def test_run_doctor_other_rank_silent_when_ok(all_ok):
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    out = io.StringIO()
    assert run_doctor(env, out) == 0
    assert out.getvalue() == ""
    all_ok.setattr(doctor, "check_h5py", lambda env: Check("h5py", False, "serial", "rebuild"))
    assert run_doctor(env, out) == 1
    assert out.getvalue().splitlines()[0].startswith("[rank 1] FAIL  h5py")


_UNDER_MPIRUN = (
    "import sys\n"
    "from hpctrain.doctor import run_doctor\n"
    "rc = run_doctor()\n"
    "from mpi4py import MPI\n"
    "MPI.COMM_WORLD.Barrier()\n"  # both reports are out before anyone exits
    "sys.stderr.write(f'rc {MPI.COMM_WORLD.Get_rank()} {rc}\\n')\n")


@pytest.mark.mpi
def test_doctor_under_mpirun():
    pytest.importorskip("mpi4py")
    proc = run_mpi(2, ["-c", _UNDER_MPIRUN], timeout=180)
    lines = proc.stdout.splitlines()
    rank0 = [line for line in lines if not line.startswith("[rank")]
    others = [line for line in lines if line.startswith("[rank")]
    # Rank 0 prints the whole table once; rank 1 prints only its own failures.
    assert sum(1 for line in rank0 if line.split()[1:2] == ["launcher"]) == 1
    assert any("openmpi: rank 0/2" in line for line in rank0)
    assert any(line.startswith("OK    mpi") and "rank 0/2" in line for line in rank0), proc.stdout
    assert rank0[-1].startswith("doctor: ")
    assert all(line.startswith("[rank 1] ") for line in others)
    assert not any(" launcher " in line or " mpi " in line for line in others), proc.stdout
    rcs = sorted(line for line in proc.stderr.splitlines() if line.startswith("rc "))
    assert [r.split()[1] for r in rcs] == ["0", "1"]
    if any(line.startswith("FAIL") for line in rank0):
        assert "rc 0 1" in rcs
    else:
        assert "rc 0 0" in rcs
