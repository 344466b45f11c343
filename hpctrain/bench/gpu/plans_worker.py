"""Run many ``hpctrain train`` command lines in ONE process, alone or under an MPI launcher.

``python -m hpctrain.bench.gpu.plans_worker OUT.json CASES.json DEVICE SCRATCH``: CASES is a
list of {"id", "argv", "env"?, "requires"?, "tf32"?, "limit_s"?}. Each case is
``hpctrain.cli.main(["train", *argv, "--device", DEVICE, "--summary", ...])`` - the command
line users run, parsed, checked and trained by the CLI's own code - so only the process start
(Python, torch, MPI, CUDA) is paid once for all of them. The device is the process's: MPI's
world binds it once. "requires" names a module the case needs (``horovod.torch``): when it
does not import, the case is skipped with the reason. "tf32" false turns TF32 off in cuDNN and
cuBLAS for that case only (torch lets cuDNN's fp32 convolutions use TF32 by default). A case
still running after "limit_s" seconds ends the process with every thread's stack on stderr.

Rank 0 rewrites OUT.json after EVERY case, {id: {"rc", "summary", "stderr", "seconds"} or
{"skip"} or {"error"}}, so a launch killed at its time box still reports the cases it ran.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import sys
import time
import traceback

from hpctrain.bench.inprocess import Tee, patched_env


@contextlib.contextmanager
def _tf32(allow):
    import torch

    if allow is None:
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(allow)
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def run_case(world, case: dict, device: str, scratch: str) -> dict:
    from hpctrain import cli

    if case.get("requires"):
        try:
            importlib.import_module(case["requires"])
        except Exception as exc:  # ImportError, or a library that fails to load
            return {"skip": f"import {case['requires']} failed: {type(exc).__name__}: {exc}"}
    summary = os.path.join(scratch, f"{case['id']}.summary.json")
    if world.rank == 0 and os.path.exists(summary):
        os.remove(summary)
    world.host.barrier()
    argv = ["train", *case["argv"], "--device", device, "--summary", summary]
    err, out = Tee(sys.stderr), Tee(sys.stdout)
    t0 = time.monotonic()
    if case.get("limit_s"):
        # A case past its limit (a hang, even inside MPI or CUDA) prints every thread's
        # stack and ends the process: the launcher starts the cases after it anew.
        faulthandler.dump_traceback_later(case["limit_s"], exit=True, file=sys.__stderr__)
    try:
        with patched_env(case.get("env", {})), _tf32(case.get("tf32")), \
                contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    except SystemExit as exc:  # argparse refuses a flag this way
        rc = exc.code if isinstance(exc.code, int) else 2
    except Exception:
        return {"error": traceback.format_exc()[-3000:], "stderr": err.copy.getvalue()[-2000:]}
    finally:
        faulthandler.cancel_dump_traceback_later()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    world.host.barrier()  # rank 0 wrote the summary before it is read
    got = None
    if world.rank == 0 and os.path.exists(summary):
        with open(summary) as f:
            got = json.load(f)
    return {"rc": rc, "summary": got, "stderr": err.copy.getvalue()[-2000:],
            "stdout": out.copy.getvalue()[-4000:],
            "seconds": time.monotonic() - t0}


def _write(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, default=str)
    os.replace(tmp, path)


def main(out_path: str, cases_path: str, device: str, scratch: str) -> None:
    from hpctrain.runtime.world import init_world

    world = init_world(device=device)
    have = world.device.type
    with open(cases_path) as f:
        cases = json.load(f)
    results = {"_world": {"size": world.size, "device": str(world.device),
                          "comm": type(world.comm).__name__}}
    if world.rank == 0:  # started: a time box from here on ends a case, not the start
        _write(out_path, results)
    for case in cases:
        if have != device.split(":")[0]:  # the world bound another device: refuse, not mix
            res = {"error": f"this process's world is on {have}, the case asks for {device}"}
        else:
            res = run_case(world, case, device, scratch)
        results[case["id"]] = res
        if world.rank == 0:
            _write(out_path, results)


if __name__ == "__main__":
    main(*sys.argv[1:5])
