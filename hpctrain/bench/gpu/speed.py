"""Single-GPU speed: hpctrain's training loop against a plain torch loop, in one process.

The same GPT (the built-in gpt's class, GPT-2 small on CUDA: 124M parameters, sequence
1024), the same batch, AdamW (fused on CUDA) and bf16 autocast with SDPA attention on both
sides. hpctrain trains through ``hpctrain.cli.main(["train", ...])``, the path users run;
its per-step times come from the run's metrics.csv (``elapsed_s`` after each step), the
warm-up steps left out. The plain loop is timed with CUDA events (host clock on CPU). The
two alternate (plain, hpctrain, hpctrain, plain) so that a clock or thermal drift falls on
both alike.

MFU = (6N + 12 * layers * seq * d_model) * tokens/s / peak: N every parameter once (the
tied embedding/head counted once), the attention term PaLM's (nanoGPT's estimate_mfu).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import io
import statistics
import time
from pathlib import Path

import torch

__all__ = ["run", "bench_gpt", "flops_per_token", "peak_flops"]

# GPT-2 small with nanoGPT's padded vocabulary (a multiple of 64)
GPU_SIZE = dict(vocab=50304, d_model=768, heads=12, layers=12, seq_len=1024)
TINY_SIZE = dict(vocab=67, d_model=48, heads=4, layers=2, seq_len=32)
LR = 3e-4
TARGET_OVERHEAD = 0.03
TARGET_MFU = 0.40
# bf16 dense peak FLOP/s by card name (no sparsity)
PEAKS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))

# What ``bench_gpt`` builds: set by ``run`` before the CLI calls the factory (in-process).
_SPEC: dict = {}


def bench_gpt():
    """The model factory the CLI is given (``--model hpctrain.bench.gpu.speed:bench_gpt``):
    the built-in gpt's GPT class at ``_SPEC``'s size and uniform random tokens. The built-in
    gpt's Markov data needs a vocab x vocab table (10 GB at 50304), so it is not used here."""
    from hpctrain.data.synthetic import TensorPairDataset
    from hpctrain.models.gpt import GPT, lm_loss

    s = _SPEC
    model = GPT(s["vocab"], s["d_model"], s["heads"], s["layers"], s["seq_len"], seed=0)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(s["vocab"], (s["samples"], s["seq_len"] + 1), generator=g)
    return model, TensorPairDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()), lm_loss


def flops_per_token(n_params: int, size: dict) -> float:
    """Training FLOPs per token: 6N + 12 * layers * seq * d_model (PaLM appendix B)."""
    return 6 * n_params + 12 * size["layers"] * size["seq_len"] * size["d_model"]


def peak_flops(device: str) -> tuple[float, str]:
    """(bf16 peak FLOP/s, how it was chosen) for this card."""
    if device != "cuda":
        return 989e12, "no GPU: H100's 989 TFLOP/s assumed"
    name = torch.cuda.get_device_name()
    for key, peak in PEAKS:
        if key in name:
            return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s bf16 dense"
    return 989e12, f"{name}: unknown card, H100's 989 TFLOP/s assumed"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _hpctrain(setup: dict, out_dir: Path) -> dict:
    """Train through the CLI; the mean step time over the steps after warm-up, from
    metrics.csv (each row's elapsed_s is taken after the step's loss is read: the GPU has
    finished its backward, so differences of rows are step times)."""
    from hpctrain import cli

    argv = ["train", "--model", "hpctrain.bench.gpu.speed:bench_gpt",
            "--steps", str(setup["steps"]), "--global-batch-size", str(setup["batch"]),
            "--lr", str(LR), "--precision", setup["precision"], "--device", setup["device"],
            "--out-dir", str(out_dir), "--summary", str(out_dir / "summary.json"),
            "--progress", "off", "--set", "train.report=false",
            "--set", "train.tensorboard=false",
            "--set", f"train.optimizer_options.fused={str(setup['fused']).lower()}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"hpctrain train exited {rc}: {printed.getvalue()[-2000:]}")
    with open(out_dir / "metrics.csv", newline="") as f:
        elapsed = [float(row["elapsed_s"]) for row in csv.DictReader(f)]
    w = setup["warmup"]
    if len(elapsed) != setup["steps"]:
        raise RuntimeError(f"metrics.csv has {len(elapsed)} rows, expected {setup['steps']}")
    steps = sorted(b - a for a, b in zip(elapsed[w - 1:], elapsed[w:]))
    return {"step_s": (elapsed[-1] - elapsed[w - 1]) / (len(elapsed) - w),
            "steps_timed": len(elapsed) - w,
            # host hiccups show as a long tail: each step waits for its loss and norm
            "spread": f"per step median {statistics.median(steps) * 1e3:.1f} ms, "
                      f"p90 {steps[int(0.9 * (len(steps) - 1))] * 1e3:.1f} ms, "
                      f"max {steps[-1] * 1e3:.1f} ms"}


def _plain_setup(setup: dict, device: str):
    """The plain loop's model (hpctrain's seed), data, optimizer and autocast dtype."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, data, _ = bench_gpt()
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=setup["fused"])
    return model, data, opt, torch.bfloat16 if setup["precision"] == "bf16" else None


def _plain(setup: dict, device: str, reads: bool = False) -> dict:
    """The same model, data, optimizer and autocast in a plain loop (no loss read per step);
    the mean step time after warm-up, from CUDA events. ``reads``: with the two host reads
    hpctrain's step makes before the optimizer steps (the loss, and the global gradient
    norm for the non-finite guard), each a device sync: what they cost alone."""
    from hpctrain.models.gpt import lm_loss
    from hpctrain.parallel.placement import global_norm

    model, data, opt, dtype = _plain_setup(setup, device)
    batch, steps, w = setup["batch"], setup["steps"], setup["warmup"]
    n = len(data.inputs)
    cuda = device == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = 0.0
    for k in range(steps):
        if k == w:
            if cuda:
                start.record()
            else:
                t0 = time.perf_counter()
        rows = [(k * batch + i) % n for i in range(batch)]
        x = data.inputs[rows].to(device, non_blocking=True)
        y = data.targets[rows].to(device, non_blocking=True)
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            loss = lm_loss(model(x), y)
        loss.backward()
        if reads:
            float(loss.detach())
            global_norm([(p.grad, 1.0) for p in model.parameters()], None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        end.record()
        end.synchronize()
        total = start.elapsed_time(end) / 1e3
    else:
        total = time.perf_counter() - t0
    out = {"step_s": total / (steps - w), "steps_timed": steps - w,
           "final_loss": float(loss.detach())}
    del model, opt
    _free(device)
    return out


# ---- what limits the step: a profile of the plain loop, GPU time by kind of kernel -------

KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("loss (softmax/cross-entropy)", ("softmax", "cross_entropy", "nll_loss")),
         ("matmul", ("gemm", "sm90", "sm80", "cutlass", "cublas", "xmma", "aten::mm",
                     "aten::addmm", "aten::bmm", "aten::linear", "matmul")),
         ("layernorm", ("layer_norm", "layernorm")))


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (elementwise, copies, embeddings)"


def _profile(setup: dict, device: str) -> dict:
    """Two plain-loop steps under torch.profiler: device time by kind, and the share of the
    step the GPU was idle (launch overhead, host syncs)."""
    from torch.profiler import ProfilerActivity, profile

    from hpctrain.models.gpt import lm_loss

    model, data, opt, dtype = _plain_setup(setup, device)
    x = data.inputs[:setup["batch"]].to(device)
    y = data.targets[:setup["batch"]].to(device)

    def step():
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: kernels chosen, optimizer state allocated
    _sync(device)
    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:  # its start (CUPTI's set-up) is not timed
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        _sync(device)
        wall = (time.perf_counter() - t0) / 2
    by_kind: dict = {}
    for ev in prof.key_averages():
        if cuda and (ev.key.startswith(("aten::", "autograd::", "Optimizer", "ProfilerStep",
                                        "cuda", "torch")) or "#" in ev.key):
            continue  # host ops and annotations: their kernels are counted as kernels
        if cuda:
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0)
        else:
            t = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0
        if t > 0:
            by_kind[_kind(ev.key)] = by_kind.get(_kind(ev.key), 0.0) + t / 1e6 / 2
    busy = sum(by_kind.values())
    return {"wall_s": wall, "busy_s": busy, "by_kind_s": by_kind,
            "idle_frac": max(0.0, 1 - busy / wall) if wall > 0 else 0.0}


def _limits_text(prof: dict) -> str:
    busy = prof["busy_s"] or 1.0
    parts = sorted(prof["by_kind_s"].items(), key=lambda kv: -kv[1])
    shares = ", ".join(f"{k} {v / busy:.0%}" for k, v in parts)
    return (f"device time by kind: {shares}; the device idle {prof['idle_frac']:.0%} of "
            f"the step (launch overhead, host syncs; under the profiler, which adds to it)")


def _setup(ctx) -> tuple[dict, dict]:
    device = ctx.device
    size = dict(TINY_SIZE if ctx.tiny else GPU_SIZE)
    batch = 8 if ctx.tiny else 16
    steps, warmup = (6, 2) if ctx.tiny else (40, 8)
    size["samples"] = batch * steps  # every step reads new samples, none twice
    setup = {"device": device, "batch": batch, "steps": steps, "warmup": warmup,
             "precision": "bf16" if device == "cuda" else "fp32",
             "fused": device == "cuda"}
    return size, setup


def run(ctx, rep) -> None:
    size, setup = _setup(ctx)
    _SPEC.clear()
    _SPEC.update(size)
    device = ctx.device
    tokens = setup["batch"] * size["seq_len"]
    rep.note(f"speed: GPT d_model {size['d_model']}, {size['heads']} heads, {size['layers']} "
             f"layers, vocab {size['vocab']}, seq {size['seq_len']}, batch {setup['batch']}, "
             f"{setup['precision']}, AdamW lr {LR} fused={setup['fused']}, "
             f"{setup['steps']} steps of which {setup['warmup']} warm-up; hpctrain through "
             f"`hpctrain train` in this process (metrics.csv step times), the plain loop "
             f"timed with {'CUDA events' if device == 'cuda' else 'the host clock'}")
    if device == "cuda":
        rep.note(f"speed: SDPA backends enabled: flash {torch.backends.cuda.flash_sdp_enabled()}"
                 f", mem-efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}; "
                 f"{torch.cuda.get_device_name()}")
    try:
        with torch.random.fork_rng(devices=[]):
            n_params = sum(p.numel() for p in bench_gpt()[0].parameters())
        fpt = flops_per_token(n_params, size)
        rep.add("speed: model parameters", "info", value=n_params,
                detail=f"{n_params / 1e6:.1f}M (tied embedding/head once); "
                       f"{fpt / 1e9:.3f} GFLOP per token trained (6N + 12*L*T*d)")
    except Exception as e:
        rep.error("speed: model parameters", e)
        return

    # ABBA: plain, hpctrain, hpctrain, plain (as long as the time box allows)
    order = ["plain", "hpctrain", "hpctrain", "plain"]
    times: dict = {"plain": [], "hpctrain": []}
    per_run = None  # seconds one run took, measured on the first
    for i, side in enumerate(order):
        if per_run is not None and ctx.left() < 2 * per_run + 5:
            rep.note(f"speed: round {i + 1} ({side}) left out: time box")
            break
        t0 = time.monotonic()
        try:
            if side == "plain":
                r = _plain(setup, device)
            else:
                r = _hpctrain(setup, ctx.scratch("speed") / f"run{i}")
                _free(device)
            times[side].append(r["step_s"])
            rep.add(f"speed: round {i + 1}: {side}", "info", value=round(tokens / r["step_s"]),
                    detail=f"tokens/s; {r['step_s'] * 1e3:.2f} ms/step over "
                           f"{r['steps_timed']} steps" + (f" ({r['spread']})"
                                                         if "spread" in r else ""))
        except Exception as e:
            rep.error(f"speed: round {i + 1}: {side}", e)
            _free(device)
        per_run = max(per_run or 0.0, time.monotonic() - t0)

    if not times["plain"] or not times["hpctrain"]:
        rep.add("speed: overhead", "skip", detail="a side has no timed run (see its error)")
        return
    t_plain = statistics.mean(times["plain"])
    t_hpc = statistics.mean(times["hpctrain"])
    tps_plain, tps_hpc = tokens / t_plain, tokens / t_hpc
    overhead = t_hpc / t_plain - 1
    rep.figure("tokens_per_s_hpctrain", round(tps_hpc))
    rep.figure("tokens_per_s_plain", round(tps_plain))
    rep.figure("overhead_pct", round(100 * overhead, 2))
    rep.add("speed: hpctrain tokens/s", "info", value=round(tps_hpc),
            detail=f"{t_hpc * 1e3:.2f} ms/step, mean of {len(times['hpctrain'])} runs")
    rep.add("speed: plain torch tokens/s", "info", value=round(tps_plain),
            detail=f"{t_plain * 1e3:.2f} ms/step, mean of {len(times['plain'])} runs")
    if device == "cuda":
        rep.add("speed: hpctrain overhead", "pass" if overhead <= TARGET_OVERHEAD else "fail",
                value=f"{100 * overhead:+.2f}%", target=f"<= {100 * TARGET_OVERHEAD:.0f}%",
                detail="t_hpctrain / t_plain - 1")
    else:
        rep.add("speed: hpctrain overhead", "info", value=f"{100 * overhead:+.2f}%",
                target=f"<= {100 * TARGET_OVERHEAD:.0f}% (GPU)",
                detail="tiny CPU sizes: information only")

    # What the guard's two host reads per step cost alone (a device sync each: the host
    # cannot queue the next step while the GPU runs this one), against the overhead.
    if per_run is not None and ctx.left() > 2 * per_run + 10:
        try:
            t_reads = _plain(setup, device, reads=True)["step_s"]
            share = ((t_reads - t_plain) / (t_hpc - t_plain) if t_hpc > t_plain else None)
            rep.add("speed: plain loop + hpctrain's two host reads per step", "info",
                    value=round(tokens / t_reads),
                    detail=f"tokens/s; {t_reads * 1e3:.2f} ms/step: the loss and the global "
                           f"gradient norm read before the optimizer steps (the non-finite "
                           f"guard) cost {100 * (t_reads / t_plain - 1):+.2f}% alone"
                           + (f", {100 * share:.0f}% of hpctrain's overhead"
                              if share is not None else ""))
        except Exception as e:
            rep.error("speed: plain loop + hpctrain's two host reads per step", e)
            _free(device)
    else:
        rep.add("speed: plain loop + hpctrain's two host reads per step", "skip",
                detail="time box")

    peak, peak_how = peak_flops(device)
    mfu_h, mfu_p = fpt * tps_hpc / peak, fpt * tps_plain / peak
    rep.figure("mfu_pct_hpctrain", round(100 * mfu_h, 1))
    rep.figure("mfu_pct_plain", round(100 * mfu_p, 1))
    detail = (f"(6N + 12*L*T*d) * tokens/s / peak; {peak_how}; plain loop "
              f"{100 * mfu_p:.1f}%")
    if device == "cuda":
        rep.add("speed: MFU (hpctrain)", "pass" if mfu_h >= TARGET_MFU else "info",
                value=f"{100 * mfu_h:.1f}%", target=f">= {100 * TARGET_MFU:.0f}% (goal)",
                detail=detail)
    else:
        rep.add("speed: MFU (hpctrain)", "info", value=f"{100 * mfu_h:.1f}%",
                detail=detail + "; a CPU: meaningless, shown to exercise the code")

    if ctx.left() < (per_run or 10) + 5:
        rep.add("speed: what limits it", "skip", detail="time box")
        return
    try:
        prof = _profile(setup, device)
        _free(device)
        rep.add("speed: what limits it", "info", value=f"{prof['idle_frac']:.0%} idle",
                detail=_limits_text(prof), profile=prof)
    except Exception as e:
        rep.error("speed: what limits it", e)
