"""What every part of the GPU check shares: its context, its report file, the MPI launch.

A part is a module ``hpctrain.bench.gpu.<name>`` with ``run(ctx: Context, rep: PartReport)``.
The driver (check.py) starts each part as ``python -m hpctrain.bench.gpu.common NAME ...`` in
its own process with a time box; the part writes ``<out>/<name>.json`` after EVERY item
(``PartReport.add`` rewrites it atomically), so a part killed at its time box still reports
what it had measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PARTS", "STATUSES", "Context", "PartReport", "Launcher", "find_launcher",
           "part_main"]

PARTS = ("facts", "speed", "plans", "memory", "watchdog", "overlap")
#: pass/fail: a check with a target; info: a measured figure without one; skip: not run
#: here, with the reason; error: the item crashed (its traceback is in ``detail``)
STATUSES = ("pass", "fail", "info", "skip", "error")


@dataclass
class Context:
    """What a part is asked to do."""

    out: Path              # the report directory (the part's scratch: out/<part>/)
    device: str            # "cuda" or "cpu"
    tiny: bool             # CPU-test sizes: seconds, not minutes
    deadline: float        # time.monotonic() by which the part must have finished
    extra: dict = field(default_factory=dict)

    def left(self) -> float:
        """Seconds left before the part's time box ends."""
        return self.deadline - time.monotonic()

    def scratch(self, part: str) -> Path:
        path = self.out / part
        path.mkdir(parents=True, exist_ok=True)
        return path


class PartReport:
    """A part's results, written to ``<out>/<part>.json`` after every change.

    Items are rows: ``add(name, status, value=..., target=..., detail=..., **more)``; the
    markdown report shows name, status, value, target and detail, the JSON everything."""

    def __init__(self, part: str, path: Path):
        self.part, self.path = part, path
        self.data = {"part": part, "items": [], "notes": [], "figures": {}}
        self._write()

    def add(self, name: str, status: str, value=None, target=None, detail: str = "", **more):
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        item = {"name": name, "status": status, "value": value, "target": target,
                "detail": detail, **more}
        self.data["items"].append(item)
        self._write()
        return item

    def error(self, name: str, exc: BaseException | None = None, detail: str = ""):
        """An item that crashed: its traceback (the last lines) goes into the report."""
        tb = traceback.format_exc() if exc is not None else ""
        return self.add(name, "error", detail=(detail + "\n" + tb[-4000:]).strip())

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self._write()

    def figure(self, key: str, value) -> None:
        """A named figure for the report's headline (tokens/s, MFU, ...)."""
        self.data["figures"][key] = value
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---- launching ranks ---------------------------------------------------------------------

@dataclass
class Launcher:
    """An MPI launcher found on this machine: ``argv(n, cmd)`` is the command line."""

    path: str
    flavour: str           # "openmpi", "mpich" (hydra) or "unknown"
    version: str

    def argv(self, n: int, cmd: list[str]) -> list[str]:
        if self.flavour == "openmpi":
            return [self.path, "-n", str(n), "--oversubscribe", "--bind-to", "none", *cmd]
        return [self.path, "-n", str(n), *cmd]

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        if self.flavour == "openmpi":
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                       OMPI_MCA_rmaps_base_oversubscribe="1")
        return env

    def run(self, n: int, cmd: list[str], timeout: float, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` on ``n`` ranks; a TimeoutExpired kills the launcher's process group."""
        return run_boxed(self.argv(n, cmd), timeout, env=self.env(env), cwd=cwd)


def find_launcher() -> Launcher | None:
    """The MPI launcher to use: $HPCTRAIN_MPIEXEC, else mpiexec or mpirun on PATH."""
    for name in (os.environ.get("HPCTRAIN_MPIEXEC", ""), "mpiexec", "mpirun"):
        path = shutil.which(name) if name else None
        if not path:
            continue
        try:
            text = subprocess.run([path, "--version"], capture_output=True, text=True,
                                  timeout=20).stdout + ""
        except (OSError, subprocess.SubprocessError):
            continue
        low = text.lower()
        flavour = ("openmpi" if "open mpi" in low or "open-mpi" in low or "openrte" in low
                   else "mpich" if "hydra" in low or "mpich" in low else "unknown")
        return Launcher(path, flavour, text.strip().splitlines()[0] if text.strip() else "")
    return None


def run_boxed(argv: list[str], timeout: float, env: dict | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run argv in its own process group; at the time box kill the whole group (an MPI
    launcher's ranks too) and raise subprocess.TimeoutExpired with what it printed."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# ---- a part's process --------------------------------------------------------------------

def part_main(argv: list[str] | None = None) -> int:
    """``python -m hpctrain.bench.gpu.common PART --out DIR --device D [--tiny] --seconds S``"""
    p = argparse.ArgumentParser(prog="hpctrain.bench.gpu.common")
    p.add_argument("part", choices=PARTS)
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--extra", default="{}", help="JSON options for the part")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out, device=a.device, tiny=a.tiny,
                  deadline=time.monotonic() + a.seconds, extra=json.loads(a.extra))
    rep = PartReport(a.part, out / f"{a.part}.json")
    try:
        module = importlib.import_module(f"hpctrain.bench.gpu.{a.part}")
        module.run(ctx, rep)
    except BaseException as e:  # the report says what broke; the driver goes on
        rep.error("part crashed", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(part_main())
