"""Run many ``hpctrain train`` command lines in ONE process (under mpirun or alone).

``python -m tests.parallel.train_worker OUT.json CASES.json``: CASES is a list of
{"id", "argv", "env"?}. Each case is ``hpctrain.cli.main(["train", *argv])`` - the CLI's own
flag parsing, config, preflight, model build, Trainer and error handling - run in this
process; only the process start (Python, torch, MPI, Horovod) is paid once for all of them.
"env" is set in os.environ for that case only. A case with "script" instead of "argv" runs
that worker script (runpy, as ``__main__``, with "args" as its command line) in this
process; its assertions abort the job
as they would in their own launch (a script case's result is {"rc": 0, "stdout",
"stderr"}). Rank 0 writes {id: {"rc", "summary",
"stdout", "stderr"}}: the exit code cmd_train returned, the JSON summary it wrote (None if
it wrote none) and what rank 0 printed during the case.

What a process can do only once is checked, not assumed: MPI's world (and the pretend
ranks-per-node it was built with) and Horovod's init-time settings (tensor fusion, cycle
time) are fixed by the first use, so a case that asks for other values is refused with an
error instead of silently running with the old ones; give such a case its own launch.
The serial-fallback warning, given once per process, is re-armed for every case.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import tempfile
import time
import warnings

from hpctrain import cli
from hpctrain.checkpoint import serial_fallback
from hpctrain.config import ConfigError, load_config
from hpctrain.runtime.world import init_world, ranks_per_node_override
from hpctrain.bench.inprocess import Tee, patched_env


def _check_process_state(world, argv: list[str]) -> None:
    """Refuse a case whose once-per-process settings differ from this process's."""
    args = cli.build_parser().parse_args(["train", *argv])
    try:
        cfg = load_config(args.config, cli._overrides(args))
    except ConfigError:
        return  # the CLI reports it itself, as it would in its own process
    per_node = ranks_per_node_override(os.environ, cfg.runtime.ranks_per_node) or world.size
    if world.node.size != per_node:
        raise RuntimeError(f"{argv}: wants {per_node} ranks per node, this process's world has "
                           f"{world.node.size}; launch it with HPCTRAIN_RANKS_PER_NODE set so")
    if cfg.train.strategy == "ddp":
        import horovod.torch as hvd

        if hvd.is_initialized():
            want = {"HOROVOD_FUSION_THRESHOLD": str(int(cfg.ddp.fusion_threshold_mb * 1024 * 1024)),
                    "HOROVOD_CYCLE_TIME": str(cfg.ddp.cycle_time_ms)}
            have = {k: os.environ.get(k) for k in want}
            if have != want:
                raise RuntimeError(f"{argv}: Horovod was started with {have}, this case needs "
                                   f"{want} (read at init only): give it its own launch")


def run_script(world, case: dict) -> dict:
    saved = sys.argv
    sys.argv = [case["script"], *case.get("args", [])]  # what its own launch would see
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(case["script"], run_name="__main__")
    except SystemExit as e:  # its sys.exit(0) ends the script, not this process
        if e.code not in (None, 0):
            raise
    finally:
        sys.argv = saved
    world.host.barrier()
    return {"rc": 0, "stdout": out.copy.getvalue(), "stderr": err.copy.getvalue()}


def run_case(world, case: dict, scratch: str) -> dict:
    if "script" in case:
        return run_script(world, case)
    argv = list(case["argv"])
    if "--summary" in argv:
        summary = argv[argv.index("--summary") + 1]
    else:
        summary = os.path.join(scratch, f"{case['id']}.json")
        argv += ["--summary", summary]
    _check_process_state(world, argv)
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    serial_fallback._warned = False  # its once-per-process warning: once per case here
    # A fresh warnings registry: a warning shown by an earlier case is shown again.
    with patched_env(case.get("env", {})), warnings.catch_warnings(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["train", *argv])
    world.host.barrier()  # rank 0 wrote the summary before anyone reads or goes on
    got = None
    if world.rank == 0 and os.path.exists(summary):
        with open(summary) as f:
            got = json.load(f)
    return {"rc": rc, "summary": got, "stdout": out.copy.getvalue(),
            "stderr": err.copy.getvalue()}


def _log_case(world, case: dict, wall: float, cpu: float) -> None:
    """With HPCTRAIN_TEST_LAUNCH_LOG=FILE (tests/mpirun.py), rank 0 appends one line per case:
    its id, the world size, wall and rank 0's CPU seconds (which cases a launch's time goes to)."""
    log = os.environ.get("HPCTRAIN_TEST_LAUNCH_LOG")
    if log and world.rank == 0:
        what = os.path.basename(case["script"]) if "script" in case else "train"
        with open(log, "a") as f:
            f.write(f"case:{case['id']}\t{world.size}\t{wall:.2f}\t{cpu:.2f}\t"
                    f"{what}\n")


def main(out_path: str, cases_path: str) -> None:
    world = init_world()  # ranks per node from HPCTRAIN_RANKS_PER_NODE, for every case
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        # Every rank gets the same command line, as under the CLI: the config (saved in
        # checkpoints, checksummed) names rank 0's summary file on every rank.
        scratch = world.mpi_comm.bcast(scratch, root=0)
        for c in cases:
            t0, cpu0 = time.monotonic(), time.process_time()
            results[c["id"]] = run_case(world, c, scratch)
            _log_case(world, c, time.monotonic() - t0, time.process_time() - cpu0)
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
