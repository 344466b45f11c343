"""Run a command under a real ``mpirun`` (Open MPI, oversubscribed, as root if needed)."""

import os
import resource
import subprocess
import sys
import time

from hpctrain.bench.inprocess import patched_env  # re-exported: the workers import it here

__all__ = ["mpi_env", "patched_env", "run_mpi", "run_single", "together"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpi_env(extra=None):
    """Environment for test ranks: one torch thread each, the repo on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        # A rank waiting in MPI yields its core instead of spinning on it. Open MPI does so
        # by itself only in a launch it counts as oversubscribed; a 2-rank launch beside
        # other work spins (test_tensor_equivalence spinning: 164 s, yielding: 72 s).
        OMPI_MCA_mpi_yield_when_idle="1",
        # Loopback only: no interface probing, no warnings about missing fabrics.
        OMPI_MCA_btl="self,vader,tcp",
        OMPI_MCA_btl_tcp_if_include="lo",
        OMPI_MCA_oob_tcp_if_include="lo",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if extra:
        env.update(extra)
    return env


def _logged_run(cmd, ranks, **kw):
    """subprocess.run, and with HPCTRAIN_TEST_LAUNCH_LOG=FILE one line per launch appended to
    FILE: test id, ranks, wall and child CPU seconds (where the suite's time goes)."""
    log = os.environ.get("HPCTRAIN_TEST_LAUNCH_LOG")
    if not log:
        return subprocess.run(cmd, **kw)
    cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    try:
        return subprocess.run(cmd, **kw)
    finally:
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        what = " ".join(os.path.basename(str(a)) for a in cmd if str(a).endswith(".py")
                        or str(a) in ("-m", "hpctrain", "train", "bench"))[:60]
        with open(log, "a") as f:
            f.write(f"{test}\t{ranks}\t{time.monotonic() - t0:.2f}\t{cpu:.2f}\t{what}\n")


def run_mpi(n, args, timeout=300, env=None, check=True, cwd=None):
    """Run ``python args...`` on ``n`` ranks; return the CompletedProcess (text output)."""
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none",
           sys.executable] + list(args)
    proc = _logged_run(cmd, n, env=mpi_env(env), cwd=cwd or ROOT, capture_output=True,
                       text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mpirun -n {n} {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_single(args, timeout=300, env=None, check=True, cwd=None):
    """Run ``python args...`` as one plain process (no launcher)."""
    e = mpi_env(env)
    proc = _logged_run([sys.executable] + list(args), 1, env=e, cwd=cwd or ROOT,
                       capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"python {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_worker_json(worker: str, out, ranks: int, args, timeout=300):
    """Run ``worker OUT args...`` on ``ranks`` ranks (one plain process for 1) and return the
    JSON its rank 0 wrote to ``out`` (a path): the workers that run many cases per launch."""
    import json

    argv = [worker, str(out), *args]
    run_mpi(ranks, argv, timeout=timeout) if ranks > 1 else run_single(argv, timeout=timeout)
    with open(out) as f:
        return json.load(f)


def together(*calls):
    """Run the zero-argument ``calls`` (independent launches) at the same time; return their
    results in order. One plain process leaves a core of two idle: a launch beside it uses
    that core (each launch keeps its own timeout; the first error is raised)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result() for f in futures]
