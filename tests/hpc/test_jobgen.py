"""jobgen: jobs/ is exactly the templates rendered for PRESETS; flags land in the script."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from hpctrain.jobgen import PRESETS, JobSpec, render
from tests.mpirun import ROOT

JOBS = os.path.join(ROOT, "jobs")


def _jobgen(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "jobgen", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_jobs_dir_is_rendered_from_templates(name):
    with open(os.path.join(JOBS, name)) as fh:
        shipped = fh.read()
    assert shipped == render(PRESETS[name], name), (
        f"jobs/{name} differs from its template; regenerate with "
        f"`python -m hpctrain jobgen --presets jobs` (edit hpctrain/jobscripts/*.in, not jobs/)")
    assert subprocess.run(["bash", "-n", os.path.join(JOBS, name)]).returncode == 0


def test_every_jobs_file_is_a_preset():
    assert sorted(os.listdir(JOBS)) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_header_command_reproduces_the_script(name, tmp_path):
    """The `jobgen ...` line in each script's header regenerates it byte for byte."""
    text = open(os.path.join(JOBS, name)).read()
    args = re.search(r"`python -m hpctrain jobgen ([^`]*)`", text).group(1)
    out = tmp_path / name
    _jobgen(*shlex.split(args), "-o", str(out))
    assert out.read_text() == text


def test_slurm_gpu_flags(tmp_path):
    out = tmp_path / "big.sbatch"
    _jobgen("--scheduler", "slurm", "--nodes", "16", "--gpus-per-node", "8", "--cpus-per-task",
            "12", "--partition", "gpu-large", "--account", "abc123", "--time", "1-00:00:00",
            "--strategy", "zero3", "--preemptible", "-o", str(out))
    text = out.read_text()
    for line in ("#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-task=1",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --partition=gpu-large",
                 "#SBATCH --account=abc123", "#SBATCH --time=1-00:00:00", "#SBATCH --requeue",
                 "#SBATCH --signal=USR1@90", "--strategy zero3", "--resume auto",
                 "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
                 "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}",
                 'echo "hpctrain: python is $(command -v python)"', "# export NCCL_SOCKET_IFNAME"):
        assert line in text, line
    assert "{{" not in text and os.access(out, os.X_OK)


def test_pbs_gpu_flags():
    text = _jobgen("--scheduler", "pbs", "--nodes", "10", "--gpus-per-node", "4",
                   "--queue", "prod", "--account", "proj").stdout
    for line in ("#PBS -l select=10:ncpus=32:mpiprocs=4:ngpus=4", "#PBS -q prod", "#PBS -A proj",
                 "NRANKS_PER_NODE=4", 'mpiexec -n "$NTOTRANKS" --ppn "$NRANKS_PER_NODE"',
                 'echo "hpctrain: python is $(command -v python)"'):
        assert line in text, line
    assert "#PBS -r y" not in text  # only pre-emptible jobs are rerunnable


def test_cpu_script_has_no_gpu_lines():
    text = render(JobSpec("slurm", ranks_per_node=8))
    assert "gpus" not in text and "NCCL" not in text and "--ntasks-per-node=8" in text


@pytest.mark.parametrize("args, message", [
    (["--time", "90"], "--time '90'"),
    (["--nodes", "0"], "--nodes 0"),
    (["--partition", "a;rm -rf"], "--partition"),
    (["--strategy", "single"], "--strategy 'single'"),
])
def test_bad_input_is_one_clear_error(args, message):
    proc = _jobgen(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("error") == 1, proc.stderr


def test_pbs_header_names_the_queue_flag_it_was_given():
    text = _jobgen("--scheduler", "pbs", "--queue", "prod").stdout
    assert "--queue prod" in text and "--partition" not in text
    assert "#PBS -q prod" in text
    assert "--partition gpu" in _jobgen("--scheduler", "slurm", "--partition", "gpu").stdout
