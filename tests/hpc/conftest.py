"""Fixtures for the HPC integration tests: a real SLURM cluster, the run environment."""

import json
import os
import shutil
import sys

import pytest

from tests.hpc.slurm_cluster import SlurmCluster, missing_binaries
from tests.mpirun import ROOT, mpi_env, run_mpi

# Every SLURM test trains the same thing, so one mpirun run is the reference for all of them.
REF_ARGS = ["--model", "mlp", "--steps", "20", "--global-batch-size", "32"]
VENV = sys.prefix  # the virtualenv running the tests; job scripts activate it (HPCTRAIN_VENV)
LMOD_INIT = "/usr/share/lmod/lmod/init/bash"  # Lmod of the OS package (`make setup`)


def job_env(**extra):
    """Environment for jobs: this checkout first on PYTHONPATH, this venv, loopback MPI."""
    env = mpi_env()
    for k in list(env):  # a stray outer allocation must not leak into the test cluster
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "PBS_", "PALS_")):
            del env[k]
    # The jobs' ranks outnumber the VM's cores; a job with cpus-per-task > 1 runs that many
    # OpenMP threads per rank, and idle ones spinning would starve the other ranks.
    env.update(HPCTRAIN_VENV=VENV, PATH=os.path.join(VENV, "bin") + os.pathsep + env["PATH"],
               OMP_WAIT_POLICY="PASSIVE", **{k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running one-node SLURM for the session; stopped (daemons killed) even on failure."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM/munge not installed ({', '.join(missing)} missing); "
                    "`make setup` as root installs slurm-wlm and munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster needs root (munged runs as the munge user, slurmd as root)")
    if not os.path.exists(os.path.join(VENV, "bin", "activate")):
        pytest.skip(f"tests must run from a virtualenv (job scripts activate it); "
                    f"{VENV} is not one")
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.env = job_env(SLURM_CONF=cluster.conf)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Summary of `mpirun -n 4 ... --strategy ddp` with REF_ARGS (the uninterrupted run)."""
    path = tmp_path_factory.mktemp("ref") / "summary.json"
    run_mpi(4, ["-m", "hpctrain", "train", "--strategy", "ddp", "--progress", "off",
                "--out-dir", "", "--summary", str(path)] + REF_ARGS, timeout=300)
    return json.loads(path.read_text())


def copy_job(name, dest, edits=()):
    """Copy jobs/<name> to dest, applying (old, new) site edits; fail if an edit misses."""
    text = open(os.path.join(ROOT, "jobs", name)).read()
    for old, new in edits:
        assert old in text, f"{name}: expected to find {old!r} to parameterise"
        text = text.replace(old, new)
    path = os.path.join(dest, name)
    with open(path, "w") as fh:
        fh.write(text)
    shutil.copymode(os.path.join(ROOT, "jobs", name), path)
    return path
