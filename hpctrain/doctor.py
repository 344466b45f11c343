"""Check hpctrain's stack (torch, launcher, MPI, Horovod, parallel h5py); say how to fix it."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence, TextIO

from hpctrain.version import __version__
from hpctrain.runtime.launcher import LaunchInfo, detect_launcher

__all__ = ["Check", "CHECK_NAMES", "collect", "format_report", "run_doctor",
           "check_python", "check_torch", "check_cuda", "check_launcher", "check_mpi",
           "check_horovod", "check_h5py"]

CHECK_NAMES = ("python", "torch", "cuda", "launcher", "mpi", "horovod", "h5py")

MPI_FIX = ("install an MPI (apt-get install openmpi-bin libopenmpi-dev, or module load <mpi>) "
           "and reinstall mpi4py")
MPI_MISMATCH_FIX = (
    "mpi4py must use the MPI that launched the job: rebuild it with that MPI's compiler "
    "(MPICC=$(which mpicc) pip install --no-binary=mpi4py --no-cache-dir --force-reinstall "
    "mpi4py); under srun pick an MPI plugin (srun --mpi=pmix; list them with srun --mpi=list)")
HOROVOD_FIX = "run `make setup` (builds Horovod 0.28.1 with HOROVOD_WITH_MPI=1)"
H5PY_FIX = ("rebuild h5py against parallel HDF5: CC=mpicc HDF5_MPI=ON HDF5_DIR=... "
            "pip install --no-binary=h5py --no-build-isolation h5py")

# Launchers that start MPI ranks; under them MPI must see the same world as the environment.
_MPI_LAUNCHERS = ("openmpi", "pals", "hydra", "slurm")


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report: what was checked, whether it passed, how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None


def _launch(env: Mapping[str, str]) -> LaunchInfo | None:
    """Return the detected launch, or None when the environment is malformed."""
    try:
        return detect_launcher(env)
    except ValueError:
        return None


def _world_mismatch(what: str, rank: int, size: int, env: Mapping[str, str]) -> str | None:
    """Describe how ``what``'s rank/size disagree with the launcher's, or None when they agree."""
    info = _launch(env)
    if info is None or info.launcher not in _MPI_LAUNCHERS:
        return None
    if (rank, size) == (info.rank, info.size):
        return None
    return (f"{what} sees rank {rank}/{size} but {info.launcher} launched rank "
            f"{info.rank}/{info.size}")


def check_python(env: Mapping[str, str]) -> Check:
    """Report the Python interpreter and hpctrain version."""
    return Check("python", True,
                 f"{platform.python_version()} ({sys.executable}), hpctrain {__version__}")


def check_torch(env: Mapping[str, str]) -> Check:
    """Report torch's version and intra-op thread count."""
    try:
        import torch
    except ImportError as exc:
        return Check("torch", False, f"not importable: {exc}",
                     "install torch: run `make setup` (or pip install torch)")
    return Check("torch", True, f"{torch.__version__}, {torch.get_num_threads()} thread(s)")


def _nccl_version(torch_module) -> str:
    """Return torch's NCCL version as text, or why it is unknown."""
    try:
        version = torch_module.cuda.nccl.version()
    except (AttributeError, RuntimeError) as exc:
        return f"unknown ({exc})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def check_cuda(env: Mapping[str, str]) -> Check:
    """Report CUDA devices and NCCL, and whether HPCTRAIN_DEVICE can be honoured."""
    try:
        import torch
    except ImportError:
        return Check("cuda", False, "torch is not importable", "fix the torch check first")
    from hpctrain.runtime.device import select_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    detail = (f"{count} device(s), NCCL {_nccl_version(torch)}" if count
              else "not available (CPU only)")
    info = _launch(env)
    try:
        device = select_device(info.local_rank if info else 0, env, count)
    except ValueError as exc:
        message, _, fix = str(exc).partition("; fix: ")
        return Check("cuda", False, f"{detail}; {message}", fix or None)
    return Check("cuda", True, f"{detail}; this rank uses {device}")


def check_launcher(env: Mapping[str, str]) -> Check:
    """Report which launcher started this process and where it sits."""
    try:
        return Check("launcher", True, detect_launcher(env).describe())
    except ValueError as exc:
        return Check("launcher", False, str(exc),
                     "fix or unset the variable named above, and start the job with "
                     "srun, mpirun/mpiexec or torchrun")


def check_mpi(env: Mapping[str, str]) -> Check:
    """Report mpi4py, the MPI library under it, and the world it sees."""
    try:
        import mpi4py
        from mpi4py import MPI  # initialises MPI; only here, so the doctor runs without it
    except (ImportError, RuntimeError, OSError) as exc:
        return Check("mpi", False, f"mpi4py.MPI failed to load: {exc}", MPI_FIX)
    # First line, up to the first comma: "Open MPI v4.1.4", "MPICH Version: 4.1.2", ...
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split(",")[0].split())
    major, minor = MPI.Get_version()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    detail = f"mpi4py {mpi4py.__version__}, {library}, MPI {major}.{minor}, rank {rank}/{size}"
    mismatch = _world_mismatch("MPI", rank, size, env)
    if mismatch:
        return Check("mpi", False, f"{detail}; {mismatch}", MPI_MISMATCH_FIX)
    info = _launch(env)
    if info is not None:
        from hpctrain.errors import UsageError
        from hpctrain.runtime.world import check_launch_size

        try:
            check_launch_size(info, size)
        except UsageError as exc:  # torchrun: N processes, each its own one-rank MPI world
            message, _, fix = str(exc).partition(" Fix: ")
            return Check("mpi", False, f"{detail}; {message}", fix or None)
    return Check("mpi", True, detail)


def _yes(value) -> str:
    return "yes" if value else "no"


def check_horovod(env: Mapping[str, str]) -> Check:
    """Report whether Horovod imports, was built with MPI, and runs its MPI controller."""
    try:
        import horovod
        import horovod.torch as hvd
    except (ImportError, OSError) as exc:  # missing, or built against another torch/MPI
        return Check("horovod", False, f"not importable: {exc}", HOROVOD_FIX)
    built = (f"{horovod.__version__}, built mpi={_yes(hvd.mpi_built())} "
             f"gloo={_yes(hvd.gloo_built())} nccl={_yes(hvd.nccl_built())}")
    if not hvd.mpi_built():
        return Check("horovod", False, f"{built}; built without MPI", HOROVOD_FIX)
    try:
        hvd.init()
    except (RuntimeError, ValueError, OSError) as exc:
        return Check("horovod", False, f"{built}; hvd.init() failed: {exc}",
                     f"check the mpi line above, then {HOROVOD_FIX}")
    detail = f"{built}; mpi_enabled={_yes(hvd.mpi_enabled())}, rank {hvd.rank()}/{hvd.size()}"
    if not hvd.mpi_enabled():
        return Check("horovod", False, detail,
                     "Horovod fell back to Gloo: unset HOROVOD_GLOO and HOROVOD_CONTROLLER, "
                     "and launch with srun/mpirun instead of horovodrun --gloo")
    mismatch = _world_mismatch("Horovod", hvd.rank(), hvd.size(), env)
    if mismatch:
        return Check("horovod", False, f"{detail}; {mismatch}",
                     f"Horovod must be built against the launching MPI: {HOROVOD_FIX}")
    return Check("horovod", True, detail)


def check_h5py(env: Mapping[str, str]) -> Check:
    """Report h5py, its HDF5, and whether that HDF5 is the parallel (MPI) build."""
    try:
        import h5py
    except (ImportError, OSError) as exc:
        return Check("h5py", False, f"not importable: {exc}", H5PY_FIX)
    mpi = bool(h5py.get_config().mpi)
    detail = f"{h5py.version.version}, HDF5 {h5py.version.hdf5_version}, mpi={_yes(mpi)}"
    return Check("h5py", mpi, detail, None if mpi else H5PY_FIX)


def collect(env: Mapping[str, str] | None = None) -> list[Check]:
    """Run every check in CHECK_NAMES order and return the results."""
    env = os.environ if env is None else env
    # Looked up at call time, so tests can monkeypatch any single check.
    return [check_python(env), check_torch(env), check_cuda(env), check_launcher(env),
            check_mpi(env), check_horovod(env), check_h5py(env)]


def format_report(checks: Sequence[Check], rank: int = 0) -> str:
    """Return rank 0's full table and verdict, or another rank's failures only ("" if none)."""
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        if c.ok and rank != 0:
            continue
        lines.append(f"{'OK' if c.ok else 'FAIL':<4}  {c.name:<{width}}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    if rank != 0:
        return "".join(f"[rank {rank}] {line}\n" for line in lines)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        lines.append(f"doctor: {len(failed)} of {len(checks)} checks failed "
                     f"({', '.join(failed)})")
    else:
        lines.append(f"doctor: all {len(checks)} checks passed")
    return "\n".join(lines) + "\n"


def run_doctor(env: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    """Run the checks, print the report (rank 0 in full), return 0 when all pass, else 1."""
    env = os.environ if env is None else env
    out = sys.stdout if out is None else out  # resolved now, so redirected stdout is honoured
    checks = collect(env)
    info = _launch(env)
    text = format_report(checks, info.rank if info else 0)
    if text:
        out.write(text)
        out.flush()
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(run_doctor())
