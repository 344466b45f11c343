"""GPU check, part ``memory``: device memory of the sharded plans vs the ZeRO formula.

1. zero1, zero2, zero3, fsdp at 2 ranks on the one GPU (MPI staged via host:
   HPCTRAIN_COMM=mpi), one launch, strategies in turn (memory_worker.py): per rank
   ``torch.cuda.max_memory_allocated`` over a few AdamW steps above the allocation before
   the model, against the formula + the strategy's buffers (memory_report's limits, as
   ``hpctrain bench memory`` computes them); target <= 1.10.
2. Activation checkpointing (in this process, one GPU): the built-in GPT's peak over one
   training step with and without ``checkpoint_blocks`` (what train.activation_checkpointing
   maps to); info, with the ratio.
3. Deferred init at scale: zero3 at 2 ranks BUILDS (no step) a stack whose fp32 parameters
   are about 0.55 x the GPU's memory; each rank's build peak <= 1.10 x (its shard + one
   unit). Deferred init builds each layer on the CPU and copies the rank's part to the
   GPU, so the size is the largest whose build, extrapolated from item 1's zero3 build
   rate, fits ~25 s.
On cpu --tiny the same code runs at tiny sizes; the CUDA figures do not exist there, so the
items say "skip" with the memory_report figures in the detail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from hpctrain.bench.gpu.common import find_launcher

TARGET = 1.10
STRATEGIES = ("zero1", "zero2", "zero3", "fsdp")
BIG_FRACTION = 0.55     # the big build's fp32 parameters over the GPU's memory
BIG_BUILD_S = 50.0      # at most this long for the big build itself (CPU RNG bound)
LAUNCH_S = 15.0         # two ranks' start (torch, MPI, CUDA) and end, beside the work
MB = 2 ** 20
#: cpu --tiny: the build item's size, run in item 1's launch (one launch less)
TINY_BUILD = {"width": 256, "layers": 8}


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / MB:.1f} MB"


def _launch(ctx, args: dict, timeout: float) -> dict:
    launcher = find_launcher()
    if launcher is None:
        raise RuntimeError("no MPI launcher (mpiexec/mpirun) on PATH: set HPCTRAIN_MPIEXEC")
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.getcwd())
    env["HPCTRAIN_COMM"] = "mpi"  # two ranks on one GPU: NCCL refuses; MPI staged via host
    env.setdefault("OMP_NUM_THREADS", "1" if ctx.device == "cpu" else "8")
    proc = launcher.run(2, [sys.executable, "-m", "hpctrain.bench.gpu.memory_worker",
                            json.dumps({"device": ctx.device, **args})], timeout=timeout,
                        env=env)
    got = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not got:
        raise RuntimeError(f"memory_worker {args.get('mode')} exited {proc.returncode}\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return json.loads(got[-1])


def _strategies(ctx, rep) -> dict | None:
    """Item 1; returns the worker's figures (for item 3's build rate) or None."""
    from hpctrain.bench.memory import buffers_bytes
    from hpctrain.bench.workload import formula_bytes

    sizes = (dict(params_m=0.2, width=128, batch=8, steps=2) if ctx.tiny else
             dict(params_m=60.0, width=4096, batch=16, steps=3))
    # item 1 at most 40 s: items 2 and 3 (the big build) need the rest
    timeout = ctx.left() - 5 if ctx.tiny else min(40.0, ctx.left() - 20)
    if timeout < (5 if ctx.tiny else 20):
        for s in STRATEGIES:
            rep.add(f"memory {s} @2 vs formula", "skip", detail="time box")
        return None
    extra = {"then_build": TINY_BUILD} if ctx.tiny else {}
    try:
        res = _launch(ctx, {"mode": "train", "strategies": list(STRATEGIES), **sizes, **extra},
                      timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        for s in STRATEGIES:
            rep.add(f"memory {s} @2 vs formula", "error",
                    detail=f"the 2-rank launch failed: {str(e)[-3000:]}")
        return None
    n = res["world_size"]
    for s in STRATEGIES:
        name = f"memory {s} @{n} vs formula"
        try:
            ranks = res["results"][s]
            psi, unit = ranks[0]["psi"], ranks[0]["unit_bytes"]
            f = formula_bytes(s, psi, n, unit)
            b = max(buffers_bytes(r["memory_report"]) for r in ranks)
            budget = f + b
            desc = (f"{psi / 1e6:.1f}M fp32 params ({sizes['params_m']}M target, Linear "
                    f"{sizes['width']}), AdamW(foreach=False: torch's foreach temporaries "
                    f"are not the strategy's), {sizes['steps']} steps, batch {sizes['batch']}, "
                    f"comm {res['comm']}; formula {_mb(f)} + buffers {_mb(b)} "
                    f"(reduction, prefetch, a unit's gradients: memory_report's limits)")
            if ctx.device != "cuda":
                m = ranks[0]["memory_report"]
                rep.add(name, "skip", value=None, target=f"<= {TARGET:.2f}",
                        detail=f"no CUDA: max_memory_allocated does not exist on cpu; ran "
                               f"the same code at tiny size. {desc}; memory_report rank 0: "
                               f"params {_mb(m['params'])}, grads {_mb(m['grads'])}, "
                               f"optimizer {_mb(m['optimizer'])}")
                continue
            peak = max(r["train_above"] for r in ranks)
            ratio = peak / budget
            rep.add(name, "pass" if ratio <= TARGET else "fail", value=round(ratio, 3),
                    target=f"<= {TARGET:.2f}",
                    detail=f"peak (max over ranks of max_memory_allocated above the "
                           f"pre-model allocation) {_mb(peak)}; {desc}; peak/formula "
                           f"{peak / f:.3f}; build peak {_mb(max(r['build_above'] for r in ranks))}")
            rep.figure(f"memory_{s}_ratio", round(ratio, 3))
        except Exception as e:  # noqa: BLE001 - the other strategies still report
            rep.error(name, e)
    return res


def _activation_checkpointing(ctx, rep) -> None:
    """Item 2: one GPT training step's peak with and without activation checkpointing."""
    import torch

    from hpctrain.models.gpt import GPT, lm_loss
    from hpctrain.parallel.activation_checkpointing import checkpoint_blocks

    name = "activation checkpointing saving (gpt, one step)"
    if ctx.left() < (3 if ctx.tiny else 12):
        rep.add(name, "skip", detail="time box")
        return
    cfg = (dict(vocab=67, d_model=48, heads=4, layers=2, seq_len=32) if ctx.tiny else
           dict(vocab=8192, d_model=1024, heads=16, layers=12, seq_len=1024))
    batch = 2 if ctx.tiny else 8
    dev = torch.device("cuda" if ctx.device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = GPT(**cfg).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq_len"] + 1), generator=g).to(dev)

    def step() -> tuple:
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        norm = float(sum(p.grad.double().square().sum() for p in model.parameters()
                         if p.grad is not None))
        opt.zero_grad(set_to_none=True)  # no update: the second run sees the same model
        peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
        return float(loss.detach()), norm, peak

    w = torch.randn(64, 64, device=dev, requires_grad=True)  # cuBLAS's workspace: not
    (w @ w).sum().backward()                                 # in the first step's peak
    del w
    loss0, norm0, plain = step()
    blocks = checkpoint_blocks(model, is_main=False)
    loss1, norm1, ckpt = step()
    params = sum(p.numel() for p in model.parameters())
    same = f"loss {loss0:.6f} / {loss1:.6f}, grad norm^2 {norm0:.6g} / {norm1:.6g}"
    desc = (f"GPT d_model {cfg['d_model']}, {cfg['layers']} layers ({blocks} checkpointed), "
            f"seq {cfg['seq_len']}, batch {batch}, vocab {cfg['vocab']}, {params / 1e6:.1f}M "
            f"params, fp32; forward+backward; {same}")
    if dev.type != "cuda":
        rep.add(name, "skip", detail=f"no CUDA: peak device memory does not exist on cpu; "
                                     f"ran the same step at tiny size. {desc}")
        return
    ratio = ckpt / plain
    rep.add(name, "info", value=round(ratio, 3), target="info (checkpointed / plain peak)",
            detail=f"peak above the model: plain {_mb(plain)}, checkpointed {_mb(ckpt)} "
                   f"({(1 - ratio) * 100:.0f}% saved); {desc}")
    rep.figure("activation_checkpointing_peak_ratio", round(ratio, 3))


def _big_build(ctx, rep, trained: dict | None) -> None:
    """Item 3: deferred init of a model over half the GPU's memory, zero3 at 2 ranks."""
    name = "deferred init: zero3 builds > half the GPU without a whole-model peak"
    import torch

    if ctx.device == "cuda":
        import gc

        gc.collect()  # item 2's model, in this process: its cached blocks go back
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = 64 * MB  # a tiny stand-in "device" so the same sizing code runs
    width = 256 if ctx.tiny else 8192
    unit_params = width * width + width
    want = int(BIG_FRACTION * total / 4)
    budget = min(0.3 if ctx.tiny else BIG_BUILD_S, ctx.left() - (3 if ctx.tiny else LAUNCH_S))
    if budget < 0.2:
        rep.add(name, "skip", detail="time box")
        return
    rate, note = None, ""
    if trained and "zero3" in trained["results"]:
        r = max(trained["results"]["zero3"], key=lambda x: x["build_s"])
        rate = r["psi"] / max(r["build_s"], 1e-3)  # parameters built per second (per rank)
    if rate is None:
        rate, note = 2e8, "no measured build rate (item 1 did not run): assumed 2e8/s; "
    fit = int(rate * budget)
    psi = min(want, fit)
    layers = max(2, psi // unit_params)
    psi = layers * unit_params
    short = psi < want * 0.98
    note += (f"the zero3 build of item 1 ran at {rate / 1e6:.0f}M params/s per rank (deferred "
             f"init builds every layer on the CPU on each rank and copies the rank's part to "
             f"the device); ")
    if short:
        note += (f"0.55 x the GPU ({want * 4 / 2**30:.1f} GiB fp32) would take "
                 f"~{want / rate:.0f} s: built the largest that fits ~{budget:.0f} s instead, "
                 f"{psi * 4 / 2**30:.1f} GiB ({psi * 4 / total:.2f} x the GPU's memory); ")
    if ctx.tiny and trained and "build" in trained["results"]:
        res = trained  # built in item 1's launch, at TINY_BUILD's size
        ranks = res["results"]["build"]
        note = (f"cpu --tiny: built in item 1's launch at a fixed size (the sizing from the "
                f"measured rate, {rate / 1e6:.0f}M params/s, chose {layers} layers of "
                f"{width} for a 64 MB stand-in device); ")
        width, layers = TINY_BUILD["width"], TINY_BUILD["layers"]
        psi = ranks[0]["psi"]
    else:
        try:
            res = _launch(ctx, {"mode": "build", "width": width, "layers": layers},
                          timeout=max(5.0, ctx.left() - 1))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            rep.add(name, "error", detail=f"{note}the 2-rank launch failed: {str(e)[-3000:]}")
            return
        ranks = res["results"]["zero3"]
    unit = ranks[0]["unit_bytes"]
    worst = max(ranks, key=lambda r: (r["build_above"] or 0) / (r["shard_bytes"] + unit))
    target = worst["shard_bytes"] + unit
    desc = (f"{note}{layers} x Linear {width} = {psi / 1e9:.2f}B fp32 params "
            f"({psi * 4 / 2**30:.2f} GiB, {psi * 4 / total:.2f} x device memory "
            f"{total / 2**30:.1f} GiB), zero3 @{res['world_size']} ({res['comm']}), SGD (no "
            f"state), no step; build {max(r['build_s'] for r in ranks):.1f} s; rank shard "
            f"{_mb(worst['shard_bytes'])} + one unit {_mb(unit)}")
    if ctx.device != "cuda":
        rep.add(name, "skip", target=f"<= {TARGET:.2f} x (shard + unit)",
                detail=f"no CUDA: the build's device peak does not exist on cpu; ran the same "
                       f"code at tiny size. {desc}")
        return
    ratio = worst["build_above"] / target
    ok = ratio <= TARGET
    rep.add(name, "pass" if ok else "fail", value=round(ratio, 3),
            target=f"<= {TARGET:.2f} x (shard + unit)",
            detail=f"build peak {_mb(worst['build_above'])} (max_memory_allocated above the "
                   f"pre-model allocation, worst rank); {desc}"
                   + ("; NOTE: smaller than half the GPU, see above" if short else ""))
    rep.figure("deferred_init_build_gib", round(psi * 4 / 2**30, 2))


def run(ctx, rep) -> None:
    t0 = time.monotonic()
    rep.note("the 2-rank items run both ranks on the one GPU through MPI staged via host "
             "(HPCTRAIN_COMM=mpi: NCCL refuses two ranks per GPU); each process's "
             "max_memory_allocated is its own")
    trained = None
    try:
        trained = _strategies(ctx, rep)
    except Exception as e:  # noqa: BLE001
        rep.error("memory strategies @2", e)
    for name, item in (("activation checkpointing saving (gpt, one step)",
                        _activation_checkpointing),
                       ("deferred init: zero3 builds > half the GPU without a whole-model peak",
                        lambda c, r: _big_build(c, r, trained))):
        try:
            item(ctx, rep)
        except Exception as e:  # noqa: BLE001 - one item's crash must not hide the others
            rep.error(name, e)
    rep.note(f"memory part: {time.monotonic() - t0:.1f} s")
