"""A real single-machine SLURM (munged + slurmctld + slurmd) living in one temp directory.

Everything (config, keys, sockets, spool, state, logs) is under ``root``; the daemons run in
the foreground as children of the test process and are killed by pid in ``stop()``, so a
failing test never leaves a cluster behind. Client commands find it through ``SLURM_CONF``
(``cluster.env``), which sbatch also exports into jobs, so ``scontrol`` works inside them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

__all__ = ["SlurmCluster", "missing_binaries", "BINARIES"]

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "squeue", "scancel")
# More CPUs than the machine has (SlurmdParameters=config_overrides): 4-task jobs must fit
# on a 2-core VM, and the GPU script asks for cpus-per-task > 1.
NODE_CPUS = 16
FAKE_GPU_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/urandom")
FAKE_GPUS = len(FAKE_GPU_DEVICES)

SLURM_CONF = """\
ClusterName=hpctrain-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobRequeue=1
KillWait=10
MinJobAge=300
InactiveLimit=0
Waittime=0
GresTypes=gpu
NodeName={host} CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory=1000 Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

# Fake GPUs for the scheduler only (the Slurm test suite's trick): --gpus-per-task is
# accounted and CUDA_VISIBLE_DEVICES set; torch (CPU build) still finds no GPU.
GRES_CONF = "Name=gpu File={root}/fakegpu[0-{last}]\n"


def missing_binaries() -> list[str]:
    """Names of the SLURM/munge programs not found on PATH or in /usr/sbin."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")


class SlurmCluster:
    """Start/stop a one-node cluster; run client commands against it with ``env``."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(self.root, "slurm.conf")
        # munged runs as the munge user, which must reach its directory: pytest's temp dirs
        # are private (0700), so munge gets its own short-pathed directory in /tmp.
        self.munge_dir = tempfile.mkdtemp(prefix="hpctrain-munge-")
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket.2")
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 60) -> "SlurmCluster":
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", self.conf])
            self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld to answer")
            self._spawn("slurmd", [_which("slurmd"), "-D", "-f", self.conf])
            self._wait(self._node_idle, timeout, "the node to become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill the daemons we started (by pid) and their job processes; idempotent."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=self.env,
                           capture_output=True, timeout=20)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.munge_dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- clients -----------------------------------------------------------------------

    def run(self, args, timeout: float = 60, check: bool = True, env=None, cwd=None):
        """Run a client command (srun, sbatch, scontrol...) against this cluster."""
        e = dict(self.env, **(env or {}))
        proc = subprocess.run(list(args), env=e, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                                 f"--- stdout ---\n{proc.stdout[-5000:]}\n"
                                 f"--- stderr ---\n{proc.stderr[-5000:]}\n{self.logs()}")
        return proc

    def job_state(self, job_id: str) -> str:
        out = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip()
        if out:
            return out
        info = self.run(["scontrol", "show", "job", job_id], check=False).stdout
        for tok in info.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job_id: str, field: str) -> str:
        info = self.run(["scontrol", "show", "job", job_id], check=False).stdout
        for tok in info.split():
            if tok.startswith(field + "="):
                return tok.split("=", 1)[1]
        return ""

    def wait_job(self, job_id: str, timeout: float, until=("COMPLETED", "FAILED", "CANCELLED",
                                                          "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                                          "PREEMPTED", "BOOT_FAIL", "DEADLINE")):
        """Poll until the job reaches one of ``until``; return that state."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in until:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {state} after {timeout}s\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.root, "log", name)
            if os.path.exists(path):
                with open(path, errors="replace") as fh:
                    out.append(f"--- {name} ---\n{fh.read()[-tail:]}")
        return "\n".join(out)

    # ---- internals ---------------------------------------------------------------------

    def _write_config(self) -> None:
        for d in ("state", os.path.join("spool", self.host), "log"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        for i, dev in enumerate(FAKE_GPU_DEVICES):
            link = os.path.join(self.root, f"fakegpu{i}")
            if not os.path.lexists(link):
                os.symlink(dev, link)  # gres needs character devices; any harmless one will do
        with open(self.conf, "w") as fh:
            fh.write(SLURM_CONF.format(host=self.host, root=self.root, ctld_port=_free_port(),
                                       slurmd_port=_free_port(), munge_socket=self.munge_socket,
                                       cpus=NODE_CPUS, gpus=FAKE_GPUS))
        with open(os.path.join(self.root, "gres.conf"), "w") as fh:
            fh.write(GRES_CONF.format(root=self.root, last=FAKE_GPUS - 1))

    def _start_munge(self) -> None:
        # munged refuses root and checks that its key and socket directory belong to it.
        mdir = self.munge_dir
        pw = pwd.getpwnam("munge")
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(128))
        os.chmod(key, 0o400)
        for p in (mdir, key):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(mdir, 0o755)  # clients need to reach the socket
        self._spawn("munged", [_which("munged"), "-F", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={mdir}/munged.pid",
                               f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed"],
                    user=pw.pw_uid, group=pw.pw_gid)
        self._wait(lambda: os.path.exists(self.munge_socket), 20, "munged's socket")

    def _spawn(self, name: str, cmd, **kw) -> None:
        log = open(self._stdout_path(name), "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True, **kw)
        log.close()

    def _ok(self, args, needle: str) -> bool:
        try:
            proc = self.run(args, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and needle in proc.stdout

    def _node_idle(self) -> bool:
        return self._ok(["sinfo", "-h", "-N", "-o", "%T"], "idle")

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for "
                                       f"{what}\n{self._daemon_output(name)}\n{self.logs()}")
            if cond():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def _stdout_path(self, name: str) -> str:
        where = self.munge_dir if name == "munged" else os.path.join(self.root, "log")
        return os.path.join(where, f"{name}.stdout")

    def _daemon_output(self, name: str) -> str:
        path = self._stdout_path(name)
        try:
            with open(path, errors="replace") as fh:
                return fh.read()[-3000:]
        except OSError:
            return ""
