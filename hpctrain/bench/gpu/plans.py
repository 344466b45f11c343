"""Every plan on the device trains as single on the device; checkpoints cross devices.

The command lines users run (``hpctrain train ...``) run many per process
(plans_worker.py): at world size 1 in one plain process (on CUDA: the NCCL communicator at
size 1) every plan - zero1-3, fsdp, pipeline pp=1, tensor tp=1, domain dom=1 - against
single; at 2 ranks under the MPI launcher (on one GPU: the MPI communicator, staged through
host memory, HPCTRAIN_COMM=mpi) ddp, zero3, fsdp, tp=2, pp=2, dom=2 against the same world-1
single. fp32; losses and the final parameter norm within rtol 1e-5
(np.testing.assert_allclose), one pass/fail item per plan, value the largest relative
difference. Then zero3 at world 1 writes a checkpoint on one device that the other resumes
(and the reverse): rtol 1e-4 across devices, whose fp32 kernels differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from hpctrain.bench.gpu.common import Context, PartReport, find_launcher, run_boxed

RTOL = 1e-5
RTOL_CROSS = 1e-4  # a checkpoint resumed on another device: other fp32 kernels
GPT = ["--model", "gpt", "--set", "train.model_options.vocab=68", "--global-batch-size", "8",
       "--weight-decay", "0.01"]
# A 36x36 grid: its U-Net levels 36/18/9 split unevenly over dom=2 (9 rows: 5 and 4).
UNET = ["--model", "unet", "--set", "train.model_options={size = 36}",
        "--global-batch-size", "4"]
COMMON = ["--optimizer", "adamw", "--lr", "0.003", "--progress", "off", "--out-dir", ""]
DDP_STANDIN = ["--strategy", "fsdp", "--sharding-strategy", "NO_SHARD"]
# A collective pending this long ends a 2-rank launch with the watchdog's stall report
# instead of the launch's whole time box; the cases after it run in a new launch.
STALL_S = 30.0
# A case running this long (any hang, the watchdog's too) ends its process with every
# thread's stack; the cases after it run in a new launch. Cases take seconds.
CASE_S = 45.0

# (name, model, plan flags) at world size 1; "single" and "single-unet" are the references
WORLD1 = [("single", GPT, ["--strategy", "single"]),
          ("zero1", GPT, ["--strategy", "zero1"]),
          ("zero2", GPT, ["--strategy", "zero2"]),
          ("zero3", GPT, ["--strategy", "zero3"]),
          ("fsdp", GPT, ["--strategy", "fsdp"]),
          ("pipeline pp=1", GPT, ["--strategy", "pipeline", "--mesh", "pp=1"]),
          ("tensor tp=1", GPT, ["--strategy", "tensor", "--mesh", "tp=1"]),
          ("single-unet", UNET, ["--strategy", "single"]),
          ("domain dom=1", UNET, ["--strategy", "domain", "--mesh", "dom=1"])]
WORLD2 = [("ddp", GPT, ["--strategy", "ddp"]),
          ("ddp via fsdp NO_SHARD", GPT, DDP_STANDIN),
          ("zero3", GPT, ["--strategy", "zero3"]),
          ("fsdp", GPT, ["--strategy", "fsdp"]),
          ("tensor tp=2", GPT, ["--strategy", "tensor", "--mesh", "tp=2"]),
          ("pipeline pp=2", GPT, ["--strategy", "pipeline", "--mesh", "pp=2"]),
          ("domain dom=2", UNET, ["--strategy", "domain", "--mesh", "dom=2"])]


def _strategy(flags) -> str:
    return flags[flags.index("--strategy") + 1]


def _cases(ctx: Context, scratch: Path, steps: int, every: int, other: str):
    """The launches in order: (world, device, [case], weight); a case carries what its item
    needs; a launch's time box is its weight's share of the time left, so one that hangs
    leaves the later ones their time."""
    dev = ctx.device
    run = ["--steps", str(steps)]
    w1 = [{"id": f"w1 {name}", "argv": model + COMMON + run + flags, "world": 1,
           "ref": None if name.startswith("single") else
           ("w1 single-unet" if model is UNET else "w1 single"),
           "strategy": _strategy(flags), "name": f"{name} (world 1)"}
          for name, model, flags in WORLD1]
    # cuDNN's fp32 convolutions may use TF32 by default (torch's setting, not hpctrain's):
    # the U-Net pair again with TF32 off tells a TF32 difference from a wrong plan.
    for name, flags in (("single-unet", ["--strategy", "single"]),
                        ("domain dom=1", ["--strategy", "domain", "--mesh", "dom=1"])):
        w1.append({"id": f"w1 {name} no-tf32", "argv": UNET + COMMON + run + flags, "world": 1,
                   "tf32": False, "strategy": _strategy(flags),
                   "ref": None if name.startswith("single") else "w1 single-unet no-tf32",
                   "name": f"{name} (world 1, TF32 off)"})
    stall = ["--collective-timeout-s", f"{STALL_S:g}"]
    w2 = [{"id": f"w2 {name}", "argv": model + COMMON + run + stall + flags, "world": 2,
           "ref": "w1 single-unet" if model is UNET else "w1 single",
           "strategy": _strategy(flags), "name": f"{name} (world 2)"}
          for name, model, flags in WORLD2]
    w2.append({"id": "w2 domain dom=2 no-tf32", "world": 2, "tf32": False, "strategy": "domain",
               "argv": UNET + COMMON + run + stall + ["--strategy", "domain", "--mesh", "dom=2"],
               "ref": "w1 single-unet no-tf32", "name": "domain dom=2 (world 2, TF32 off)"})

    # Checkpoints: zero3 at world 1 writes every `every` steps on one device; the other
    # device resumes from the first one to the end. Both directions.
    ck = []
    for tag, write_dev, read_dev in (("a", dev, other), ("b", other, dev)):
        wdir, rdir = scratch / f"ckpt-{tag}", scratch / f"ckpt-{tag}-resumed"
        base = GPT + COMMON + run + ["--strategy", "zero3"]
        ck.append({"id": f"ck {tag} write", "device": write_dev, "world": 1,
                   "argv": base + ["--checkpoint-dir", str(wdir), "--checkpoint-every",
                                   str(every)]})
        ck.append({"id": f"ck {tag} resume", "device": read_dev, "world": 1,
                   "argv": base + ["--checkpoint-dir", str(rdir), "--resume",
                                   str(wdir / f"ckpt-{every:06d}.h5")],
                   "ref": f"ck {tag} write", "strategy": "zero3", "resumed": steps - every,
                   "write_device": write_dev,
                   "rtol": RTOL if write_dev == read_dev else RTOL_CROSS,
                   "name": f"checkpoint {write_dev} -> {read_dev}"
                           + (f" ({tag})" if write_dev == read_dev else "")})
    # In order: ck a write (dev) with world 1; then world 2; then on the other device ck a
    # resume and ck b write; then ck b resume on dev. When both devices are one (cpu --tiny)
    # the checkpoint steps join the world-1 process.
    a_w, a_r, b_w, b_r = ck
    if other == dev:
        return [(1, dev, w1 + [a_w, b_w, a_r, b_r], 4), (2, dev, w2, 4)]
    return [(1, dev, w1 + [a_w], 4), (2, dev, w2, 4), (1, other, [a_r, b_w], 1.5),
            (1, dev, [b_r], 1)]


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, dtype=float), np.asarray(ref, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(got - ref) / np.abs(ref)
    rel = np.where(got == ref, 0.0, rel)
    return float(np.max(rel)) if rel.size else 0.0


def _judge(rep: PartReport, case: dict, res: dict, ref: dict | None, device: str) -> None:
    """One item: the case's summary against its reference's."""
    name, rtol = case["name"], case.get("rtol", RTOL)
    if "skip" in res:
        rep.add(name, "skip", detail=res["skip"] + (
            "; the engine's all-reduce stands in: 'ddp via fsdp NO_SHARD'"
            if case["strategy"] == "ddp" else ""))
        return
    if "error" in res:
        rep.add(name, "error", detail=(res["error"] + "\n" + res.get("stderr", "")).strip())
        return
    if not case.get("ref"):  # a reference: it ran, or every item that needs it says so
        got = res.get("summary") or {}
        ok = res.get("rc") == 0 and got.get("strategy") == case["strategy"]
        rep.add(name, "info" if ok else "fail", value=got.get("final_loss"),
                detail=(f"the reference: {len(got.get('losses', []))} steps on {device}, "
                        f"param_norm {got.get('param_norm')}; {res.get('seconds', 0):.1f} s"
                        if ok else f"exit code {res.get('rc')}: {res.get('stderr', '')}"))
        return
    if ref is None or "summary" not in ref or ref.get("rc") != 0 or not ref.get("summary"):
        rep.add(name, "error", detail=f"its reference {case['ref']!r} did not run: "
                + (ref or {}).get("stderr", "") + (ref or {}).get("error", ""))
        return
    got = res.get("summary")
    if res.get("rc") != 0 or not got:
        rep.add(name, "fail", detail=f"exit code {res.get('rc')}: {res.get('stderr', '')}")
        return
    want = ref["summary"]
    problems = []
    if got.get("strategy") != case["strategy"] or got.get("world_size") != case["world"]:
        problems.append(f"ran {got.get('strategy')} at world {got.get('world_size')}, "
                        f"not {case['strategy']} at {case['world']}")
    if "resumed" in case and got.get("trained_steps") != case["resumed"]:
        problems.append(f"trained {got.get('trained_steps')} steps after the resume, "
                        f"not {case['resumed']}")
    if len(got["losses"]) != len(want["losses"]):
        problems.append(f"{len(got['losses'])} losses, the reference has {len(want['losses'])}")
        value = None
    else:
        value = max(_rel(got["losses"], want["losses"]),
                    _rel([got["param_norm"]], [want["param_norm"]]))
        for key in ("losses", "param_norm"):
            try:
                np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=0)
            except AssertionError as exc:
                problems.append(f"{key}: {str(exc).strip().splitlines()[-3:]}")
    where = (f"written by '{case['ref']}' on {case['write_device']}, resumed on {device} at step "
             f"{len(got['losses']) - case['resumed']}"
             + (" (both cpu: this run has no other device)" if case["write_device"] == device
                else "") if "resumed" in case else f"on {device} vs '{case['ref']}'")
    if case["strategy"] == "ddp" and "Horovod is not installed" in res.get("stdout", ""):
        where += " (Horovod absent: the ddp flavour ran on the engine's all-reduce, as its log says)"
    detail = (f"{len(got['losses'])} steps, fp32, rtol {rtol:g}"
              f"{' (devices differ)' if rtol != RTOL else ''}; {where}; "
              f"{res.get('seconds', 0):.1f} s")
    rep.add(name, "fail" if problems else "pass", value=value, target=f"<= {rtol:g}",
            detail="; ".join(problems + [detail]))


def _launch(scratch: Path, tag: str, world: int, device: str, cases: list, launcher,
            timeout: float) -> tuple[dict, str]:
    """Run one worker process (or ``world`` ranks); its results and what went wrong."""
    cases_path, out = scratch / f"cases-{tag}.json", scratch / f"out-{tag}.json"
    cases_path.write_text(json.dumps([
        {"limit_s": CASE_S, **{k: c[k] for k in ("id", "argv", "requires", "tf32") if k in c}}
        for c in cases]))
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["HPCTRAIN_DATA_DIR"] = str(scratch / "data")
    if world > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
        if device == "cuda":
            env["HPCTRAIN_COMM"] = "mpi"  # NCCL refuses two ranks on one GPU
    cmd = [sys.executable, "-m", "hpctrain.bench.gpu.plans_worker", str(out), str(cases_path),
           device, str(scratch)]
    problem = ""
    try:
        if world == 1:
            proc = run_boxed(cmd, timeout, env=env, cwd=root)
        else:
            proc = launcher.run(world, cmd, timeout=timeout, env=env, cwd=root)
        if proc.returncode != 0:
            problem = f"the launch exited {proc.returncode}: {(proc.stderr or '')[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        problem = f"time box: the launch was killed after {timeout:.0f} s; {err[-3000:]}"
    results = json.loads(out.read_text()) if out.exists() else {}
    return results, problem


def run(ctx: Context, rep: PartReport) -> None:
    scratch = ctx.scratch("plans")
    steps, every = (4, 2) if ctx.tiny else (10, 5)
    other = "cpu"  # the other device of the checkpoint pair (on cpu: cpu again)
    launches = _cases(ctx, scratch, steps, every, other)
    launcher = find_launcher()
    how = f"{launcher.path} ({launcher.version})" if launcher else "no MPI launcher"
    rep.note(f"plans: fp32, {steps} steps, built-in gpt (vocab 68) and unet (36x36) at their "
             f"default sizes, adamw; world 2 via {how}"
             f"{', HPCTRAIN_COMM=mpi' if ctx.device == 'cuda' else ''}, collective timeout "
             f"{STALL_S:g} s; checkpoints by zero3 at world 1 ({ctx.device} <-> {other})")
    results: dict = {}
    for i, (world, device, cases, weight) in enumerate(launches):
        later = sum(w for *_, w in launches[i + 1:])
        pending, attempt = list(cases), 0
        while pending:
            if world > 1 and launcher is None:
                _skip(rep, pending, "no MPI launcher (mpiexec/mpirun) on PATH")
                break
            reserve = 2.0 if ctx.tiny else 5.0
            if ctx.left() < reserve + (3 if ctx.tiny else 15):
                _skip(rep, pending, "time box")
                break
            tag = f"{i}" if attempt == 0 else f"{i}.{attempt}"
            box = (ctx.left() - reserve) * weight / (weight + later)
            try:
                got, problem = _launch(scratch, tag, world, device, pending, launcher, box)
            except Exception as exc:
                for c in pending:
                    if "name" in c:
                        rep.error(c["name"], exc)
                break
            if problem:
                rep.note(f"launch {tag} (world {world}, {device}): {problem[:300]}")
            if "_world" in got:
                rep.note(f"launch {tag}: {got['_world']}")
            results.update(got)
            pending = _judge_launch(rep, pending, got, problem, results, device, tag)
            attempt += 1
    _figures(rep)


def _skip(rep: PartReport, cases: list, why: str) -> None:
    for c in cases:
        if "name" in c:
            rep.add(c["name"], "skip", detail=why)


def _judge_launch(rep: PartReport, cases: list, got: dict, problem: str, results: dict,
                  device: str, tag: str) -> list:
    """Add the items of one launch's cases; return the cases to run again in a new launch.

    The first case without a result was running when the launch ended: killed at its time
    box (a hang, or too slow: fail) or crashed (error); the cases after it never started
    and go to a new launch, so one hang or crash does not hide the others. A worker that
    never started its cases (no "_world": imports, MPI, the device) is not retried."""
    started = "_world" in got
    culprit, rest = None, []
    for c in cases:
        res = got.get(c["id"])
        if res is not None:
            if "name" not in c:
                continue  # a checkpoint writer: judged through its reader
            try:
                _judge(rep, c, res, results.get(c["ref"]) if c.get("ref") else None, device)
            except Exception as exc:
                rep.error(c["name"], exc)
        elif culprit is None:
            culprit = c
            name = c.get("name", c["id"])
            if not started:
                how = f"launch {tag} did not start its cases: {problem or 'no result'}"
            elif problem.startswith("time box"):
                how = f"running when launch {tag}'s {problem}"
            elif "Timeout (" in problem:  # the worker's per-case limit (faulthandler)
                how = f"still running after {CASE_S:g} s (launch {tag}): {problem}"
            else:
                how = f"running when launch {tag} ended: {problem or 'no result written'}"
            hung = problem.startswith("time box") or "Timeout (" in problem
            status = "fail" if started and hung else "error"
            if "name" in c:
                rep.add(name, status, detail=how[:3500])
            else:
                rep.note(f"{name}: {how[:3500]}")
        else:
            rest.append(c)
    if culprit is not None and (not started or not problem):
        for c in rest:  # nothing to gain from another launch
            if "name" in c:
                rep.add(c["name"], "error", detail=f"not run: launch {tag} ended before it")
        return []
    return rest


def _figures(rep: PartReport) -> None:
    items = [i for i in rep.data["items"] if i["status"] in ("pass", "fail")]
    rep.figure("plans passed", f"{sum(i['status'] == 'pass' for i in items)}/{len(items)}")
    same = [i["value"] for i in items if i["value"] is not None
            and not i["name"].startswith("checkpoint")]
    if same:
        rep.figure("plans max rel diff vs single", max(same))
