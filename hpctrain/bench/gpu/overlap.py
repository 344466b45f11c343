"""Overlap: how much of a step's gradient reduction and fsdp prefetch hides behind compute.

Two ranks (on the one GPU: MPI staged through host memory, HPCTRAIN_COMM=mpi; NCCL refuses
two ranks per GPU) train a stack of Linear layers under each data-parallel flavour of the
sharding engine: fsdp NO_SHARD (the engine's all-reduce: the ddp flavour's Horovod is not
on the GPU machine), zero2, zero3 and fsdp FULL_SHARD. The worker (overlap_worker.py)
measures t_step, t_compute (no communication) and t_comm (the step's collectives, read from
the flight recorder, replayed alone); here exposed = t_step - t_compute and
overlap = 1 - exposed / t_comm, as information items (the issue sets no target).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hpctrain.bench.gpu.common import find_launcher

__all__ = ["run", "FLAVOURS"]

FLAVOURS = ("fsdp:NO_SHARD", "zero2", "zero3", "fsdp")
GPU_SIZE = dict(width=2048, layers=8, batch=4096, warmup=2, steps=5, reps=3)
TINY_SIZE = dict(width=64, layers=4, batch=16, warmup=1, steps=2, reps=1)
WHAT = {"fsdp:NO_SHARD": "all-reduce of the gradients (the engine's, as ddp)",
        "zero2": "reduce-scatter of the gradients, all-gather of the updated parameters",
        "zero3": "all-gather of each unit's parameters (forward and backward), "
                 "reduce-scatter of the gradients",
        "fsdp": "all-gather prefetch of the next unit, reduce-scatter of the gradients"}


def _read(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(ctx, rep) -> None:
    launcher = find_launcher()
    if launcher is None:
        rep.add("overlap", "skip", detail="no MPI launcher (mpiexec/mpirun) on PATH: two ranks "
                                          "cannot start")
        return
    size = dict(TINY_SIZE if ctx.tiny else GPU_SIZE)
    out = ctx.scratch("overlap") / "records.jsonl"
    if out.exists():
        out.unlink()
    cfg = {"device": ctx.device, "out": str(out), "flavours": list(FLAVOURS), **size}
    env = dict(os.environ)
    if ctx.device == "cuda":
        env["HPCTRAIN_COMM"] = "mpi"  # two ranks on one GPU: MPI staged through the host
    env.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    rep.note(f"overlap: 2 ranks ({launcher.flavour}, {launcher.path}), Linear stack width "
             f"{size['width']} x {size['layers']} layers, batch {size['batch']} per rank, "
             f"fp32, AdamW; {size['warmup']} warm-up + {size['steps']} timed steps (median "
             f"of the slowest rank); t_comm: the step's collectives from the flight recorder, "
             f"replayed alone on world.comm ({size['reps']} reps, median)")
    failure = ""
    try:
        proc = launcher.run(2, [sys.executable, "-m", "hpctrain.bench.gpu.overlap_worker",
                                json.dumps(cfg)], timeout=max(5.0, ctx.left() - 5), env=env)
        if proc.returncode != 0:
            failure = f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        failure = f"time box ({e.timeout:.0f} s): {err[-2000:]}"
    records = _read(out)
    world = next((r for r in records if r["kind"] == "world"), None)
    if world is not None:
        rep.note(f"overlap: world.comm is {world['comm']} (backend {world['backend']}) on "
                 f"{world['device']}, {world['size']} ranks")
        staged = "stag" in world["comm"].lower() or (ctx.device == "cuda"
                                                     and world["backend"] == "mpi")
        if staged:
            rep.note("overlap: the staged MPI path copies each CUDA tensor to host memory and "
                     "synchronizes the stream before MPI sees it, so its collectives cannot "
                     "overlap GPU compute: the exposed time below is what a step pays for "
                     "them; overlap on a GPU needs NCCL (one rank per GPU)")
        elif ctx.device == "cpu":
            rep.note("overlap: on CPU, Open MPI moves data only inside MPI calls (no progress "
                     "thread), so non-blocking collectives overlap compute only as far as the "
                     "strategy tests them between layers")
    flavours = {r["name"]: r for r in records if r["kind"] == "flavour"}
    nocomm = flavours.get("nocomm")
    if nocomm is not None and "t_step" in nocomm:
        rep.add("overlap: compute alone (nocomm)", "info",
                value=f"{nocomm['t_step'] * 1e3:.2f} ms",
                detail="forward, backward and AdamW step with no communication")
    elif nocomm is not None:
        rep.add("overlap: compute alone (nocomm)", "error", detail=nocomm.get("error", ""))
    for name in FLAVOURS:
        r = flavours.get(name)
        item = f"overlap: {name}"
        if r is None:
            rep.add(item, "error" if failure else "skip",
                    detail=failure or "not measured")
            continue
        if "error" in r:
            rep.add(item, "error", detail=r["error"])
            continue
        if r.get("t_compute") is None:
            rep.add(item, "skip", detail="no compute-alone time to compare with")
            continue
        t_step, t_comp, t_comm = r["t_step"], r["t_compute"], r["t_comm"]
        exposed = t_step - t_comp
        frac = 1 - exposed / t_comm if t_comm > 0 else None
        extra = ""
        if exposed > t_comm:  # more than the collectives cost alone
            extra = (f"; the step costs {1e3 * (exposed - t_comm):.2f} ms more than compute "
                     f"plus its collectives: the strategy's own work (bucket copies, hooks, "
                     f"waits), or the two ranks contending for the device")
        if name != "fsdp:NO_SHARD":
            extra += ("; compute is nocomm's whole AdamW step, this flavour steps half the "
                      "parameters per rank (exposed errs low by that difference)")
        ops = ", ".join(f"{op} x{n} ({b / 1e6:.1f} MB)" for op, (n, b) in r["ops"].items())
        rep.add(item, "info", value=None if frac is None else f"{100 * frac:.0f}% overlapped",
                detail=f"{WHAT[name]}: step {t_step * 1e3:.2f} ms, compute {t_comp * 1e3:.2f} "
                       f"ms, exposed {exposed * 1e3:.2f} ms/step, collectives alone "
                       f"{t_comm * 1e3:.2f} ms ({ops or 'none recorded'}){extra}",
                t_step_s=t_step, t_compute_s=t_comp, t_comm_s=t_comm, exposed_s=exposed,
                overlap=frac)
        rep.figure(f"exposed_ms_{name}", round(exposed * 1e3, 2))
    if failure and flavours:
        rep.note(f"overlap: the worker failed after {len(flavours)} records: {failure[-500:]}")
