"""PBS Pro / Cray PALS job scripts run under an emulated PBS job (no PBS server here).

The emulation sets what PBS gives a job script (PBS_NODEFILE, PBS_JOBID, PBS_O_WORKDIR,
PBS_JOBNAME, PBS_ENVIRONMENT...) and puts a `mpiexec` shim first on PATH that accepts Cray
PALS's options (-n, --ppn, --depth, --cpu-bind, --env), checks them against the node file,
and starts the ranks with Open MPI's mpirun, each rank seeing the variables PALS sets
(PALS_RANKID, PALS_LOCAL_RANKID, PALS_NODEID, PMI_SIZE) instead of Open MPI's.
The jobs run side by side (tests/hpc/side_by_side.py): the pre-empted one mostly waits on its
paced steps while the others start; each test checks its own job.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.hpc.conftest import LMOD_INIT, VENV, copy_job, job_env
from tests.hpc.procs import session_procs
from tests.hpc.side_by_side import SideBySide
from tests.mpirun import ROOT

pytestmark = pytest.mark.mpi

MPIEXEC_SHIM = r"""#!/bin/bash
# Test stand-in for Cray PALS mpiexec: PALS options -> Open MPI mpirun, PALS variables per rank.
set -euo pipefail
n=""; ppn=""; envs=()
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--np) n=$2; shift 2;;
        --ppn) ppn=$2; shift 2;;
        --depth|-d|--cpu-bind) shift 2;;
        --env|-env) envs+=(-x "$2"); shift 2;;
        --*) echo "mpiexec shim: unknown option $1" >&2; exit 2;;
        *) break;;
    esac
done
nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
[ -n "$n" ] && [ -n "$ppn" ] || { echo "mpiexec shim: -n and --ppn are required" >&2; exit 2; }
[ "$n" -eq $((nodes * ppn)) ] || { echo "mpiexec shim: -n $n != $nodes node(s) x --ppn $ppn" >&2; exit 2; }
echo "mpiexec shim: -n $n --ppn $ppn on $nodes node(s)" >&2
exec mpirun -n "$n" --oversubscribe --bind-to none "${envs[@]}" "$(dirname "$0")/pals-rank" "$@"
"""

PALS_RANK = r"""#!/bin/bash
# What PALS sets for each rank (one node here), without Open MPI's per-rank variables.
export PALS_RANKID=$OMPI_COMM_WORLD_RANK PALS_LOCAL_RANKID=$OMPI_COMM_WORLD_LOCAL_RANK
export PALS_LOCAL_SIZE=$OMPI_COMM_WORLD_LOCAL_SIZE PALS_NODEID=0 PMI_SIZE=$OMPI_COMM_WORLD_SIZE
export PALS_APID=$PBS_JOBID
unset OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE OMPI_COMM_WORLD_NODE_RANK
exec "$@"
"""


def _pbs_env(tmp_path, name, ranks_per_node, job_id="4242.pbs-server", **extra):
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    for fname, text in (("mpiexec", MPIEXEC_SHIM), ("pals-rank", PALS_RANK)):
        (shim / fname).write_text(text)
        (shim / fname).chmod(0o755)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text((socket.gethostname() + "\n") * ranks_per_node)  # one line per mpiproc
    env = job_env(**extra)
    env.update(PATH=f"{shim}{os.pathsep}{env['PATH']}", PBS_NODEFILE=str(nodefile),
               PBS_JOBID=job_id, PBS_JOBNAME=name, PBS_O_WORKDIR=str(tmp_path),
               PBS_ENVIRONMENT="PBS_BATCH", PBS_QUEUE="workq", PBS_O_HOST=socket.gethostname(),
               PBS_NODENUM="0", PBS_TASKNUM="1")
    return env


def _run_script(script, env, timeout=300):
    # PBS runs the script with the job's home directory as cwd; the script must cd itself.
    return subprocess.run(["bash", script], env=env, cwd="/", capture_output=True, text=True,
                          timeout=timeout)


def _via_module(env, tmp_path):
    """Make the job find hpctrain as a site's user does: no virtualenv activated or on PATH,
    Lmod's `module` in the job's bash (BASH_ENV, as Lmod's login setup exports it) and a
    site modulefile of this install on MODULEPATH."""
    if not os.path.exists(LMOD_INIT):
        pytest.skip("Lmod is not installed (`make setup` as root installs the lmod package)")
    subprocess.run(["bash", os.path.join(ROOT, "modules", "write-modulefile.sh"), VENV,
                    str(tmp_path / "modulefiles")], check=True, capture_output=True, timeout=60)
    del env["HPCTRAIN_VENV"]
    env.pop("VIRTUAL_ENV", None)
    shim = env["PATH"].split(os.pathsep)[0]
    env.update(PATH=f"{shim}:/usr/local/bin:/usr/bin:/bin", BASH_ENV=LMOD_INIT,
               MODULEPATH=str(tmp_path / "modulefiles"), LMOD_ALLOW_ROOT_USE="yes")


SCRIPTS = [("pbs-cpu.pbs", "venv"), ("pbs-gpu.pbs", "module")]


def pbs_script_under_emulated_pals(reference, tmp_path, name, via):
    script = copy_job(name, str(tmp_path))
    env = _pbs_env(tmp_path, name, 4, MODEL="mlp", STEPS="20")
    if via == "module":
        _via_module(env, tmp_path)
    proc = _run_script(script, env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # the ranks' python is the install's: the venv's, activated or through the module's PATH
    assert f"hpctrain: python is {VENV}/bin/python" in out, out
    assert "mpiexec shim: -n 4 --ppn 4 on 1 node(s)" in out
    assert "hpctrain: launcher=pals ranks=4 nodes=1 ranks/node=4 device=cpu" in out, out
    assert "hpctrain exit code 0" in out
    kind = "gpu" if "gpu" in name else "cpu"
    got = json.loads((tmp_path / f"hpctrain-{kind}-4242.json").read_text())
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-6, atol=0)


def _rank_pids(session_id):
    """PIDs of this job's hpctrain ranks: processes in the script's session (PBS signals those)."""
    pids = []
    for pid, data in session_procs(session_id, "cmdline"):
        cmd = data.split(b"\0")
        if b"hpctrain" in cmd and b"train" in cmd and b"-m" in cmd and not any(
                c.endswith((b"mpirun", b"pals-rank")) for c in cmd[:1]):
            pids.append(pid)
    return pids


def pbs_preempt_sigterm_then_rerun(reference, tmp_path):
    """PBS pre-emption sends SIGTERM: checkpoint, exit 75; the rerun (-r y) finishes the run."""
    script = copy_job("pbs-preempt.pbs", str(tmp_path))
    env = _pbs_env(tmp_path, "pbs-preempt.pbs", 4, MODEL="tests.fixtures.slow:factory",
                   STEPS="20", CKPT_EVERY="100", SLOW_STEP_S="0.2")
    proc = subprocess.Popen(["bash", script], env=env, cwd="/", stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "hpctrain-out" / "metrics.csv"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:  # header + 4
                break
            time.sleep(0.2)
        pids = _rank_pids(proc.pid)
        assert len(pids) == 4, pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, out
    m = re.search(r"SIGTERM received; stopped after step (\d+)", out)
    assert m and 4 <= int(m.group(1)) < 20, out
    assert "hpctrain exit code 75" in out
    # PBS reruns a rerunnable job with the same id: same script, same directory. Nothing
    # signals the rerun, so its steps need no pacing.
    rerun = _run_script(script, dict(env, SLOW_STEP_S="0"))
    out2 = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out2
    assert f"at step {m.group(1)}" in out2, out2
    got = json.loads((tmp_path / "hpctrain-preempt-4242.json").read_text())
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def jobs(request, reference, tmp_path_factory):
    """Every job of this file, run side by side; {test name: outcome}."""
    scenarios = {
        f"test_pbs_script_under_emulated_pals[{name}-{via}]":
            (lambda name=name, via=via: pbs_script_under_emulated_pals(
                reference, tmp_path_factory.mktemp(name), name, via))
        for name, via in SCRIPTS}
    scenarios["test_pbs_preempt_sigterm_then_rerun"] = lambda: pbs_preempt_sigterm_then_rerun(
        reference, tmp_path_factory.mktemp("pbs-preempt"))
    return SideBySide(request, scenarios)


@pytest.mark.parametrize("name, via", SCRIPTS)
def test_pbs_script_under_emulated_pals(jobs, request, name, via):
    jobs.check(request.node.name)


def test_pbs_preempt_sigterm_then_rerun(jobs, request):
    jobs.check(request.node.name)
