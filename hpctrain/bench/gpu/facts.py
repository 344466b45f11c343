"""Part ``facts``: what the machine has, read before anything relies on it.

torch and CUDA, the GPU (name, memory, SMs), NCCL, the MPI library mpi4py loads and the
launcher on PATH (with a 2-rank hello through it: the multi-rank parts need both), Horovod,
and the two ceilings the speed figures are read against: a bf16 matrix product's rate and a
device-to-device copy's bandwidth.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import torch

from hpctrain.bench.gpu.common import Context, PartReport, find_launcher

__all__ = ["run", "peak_bf16_flops"]

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, by a substring of the device name.
_PEAKS = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12),
          ("L40S", 362e12), ("A10", 125e12), ("V100", 125e12))

# Rank 0 prints for both: two ranks' unbuffered prints interleave.
_HELLO = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
          "r = c.gather((c.Get_rank(), c.Get_size(), c.allreduce(c.Get_rank() + 1))); "
          "c.Get_rank() or print('\\n'.join(' '.join(map(str, x)) for x in r))")


def peak_bf16_flops(name: str) -> float | None:
    """The card's dense bf16 peak in FLOP/s, None for a card not in the table."""
    for key, peak in _PEAKS:
        if key in name:
            return peak
    return None


def _timed(fn, reps: int, device: str) -> float:
    """Median seconds of fn() over reps (CUDA: events around each)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _ceilings(ctx: Context, rep: PartReport) -> None:
    dev = torch.device(ctx.device)
    n = 256 if ctx.tiny else 8192
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)  # random, never zeros
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    secs = _timed(lambda: a @ b, 10, ctx.device)
    rate = 2 * n ** 3 / secs
    rep.add(f"matmul {n}^3 {str(dtype).replace('torch.', '')}", "info",
            value=f"{rate / 1e12:.1f} TFLOP/s", detail="median of 10 after 3 warm-ups")
    rep.figure("matmul_tflops", round(rate / 1e12, 1))
    a = b = None  # free before the copy buffers
    numel = (1 << 20) if ctx.tiny else (1 << 30)  # 2 GiB of bf16 on a GPU
    src = torch.empty(numel, device=dev, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    secs = _timed(lambda: dst.copy_(src), 10, ctx.device)
    bw = 2 * src.numel() * src.element_size() / secs
    rep.add("device copy", "info", value=f"{bw / 1e9:.0f} GB/s",
            detail="bytes read + written, median of 10")
    rep.figure("copy_gbs", round(bw / 1e9))


def _mpi(ctx: Context, rep: PartReport) -> None:
    try:
        out = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                              "print(MPI.Get_library_version().strip(chr(0) + chr(32) + chr(10)).splitlines()[0])"],
                             capture_output=True, text=True, timeout=60)
        ok = out.returncode == 0
        rep.add("mpi4py's MPI library", "info" if ok else "fail",
                value=out.stdout.strip() if ok else None,
                detail="" if ok else out.stderr.strip()[-1500:])
    except (OSError, subprocess.SubprocessError) as e:
        rep.error("mpi4py's MPI library", e)
    launcher = find_launcher()
    if launcher is None:
        rep.add("MPI launcher", "fail", detail="no mpiexec or mpirun on PATH "
                "(set HPCTRAIN_MPIEXEC): the 2-rank items cannot run")
        return
    rep.add("MPI launcher", "info", value=f"{launcher.path} ({launcher.flavour})",
            detail=launcher.version)
    try:
        res = launcher.run(2, [sys.executable, "-c", _HELLO], timeout=min(60, ctx.left()))
        lines = res.stdout.split()[-6:] if res.returncode == 0 else []
        lines = [' '.join(lines[:3]), ' '.join(lines[3:])] if len(lines) == 6 else lines
        ok = res.returncode == 0 and lines == ["0 2 3", "1 2 3"]
        rep.add("2-rank hello through the launcher", "pass" if ok else "fail",
                value=" | ".join(lines) or None,
                detail="" if ok else (res.stdout + res.stderr)[-1500:])
    except subprocess.TimeoutExpired as e:
        rep.add("2-rank hello through the launcher", "fail",
                detail=f"timed out after {e.timeout:.0f} s: {(e.stderr or '')[-1000:]}")


def run(ctx: Context, rep: PartReport) -> None:
    from hpctrain.version import __version__

    rep.add("hpctrain", "info", value=__version__)
    rep.add("python", "info", value=platform.python_version(), detail=sys.executable)
    rep.add("torch", "info", value=torch.__version__,
            detail=f"CUDA {torch.version.cuda}, {os.cpu_count()} CPUs")
    rep.figure("torch", torch.__version__)
    if ctx.device == "cuda":
        if not torch.cuda.is_available():
            rep.add("CUDA device", "fail", detail="torch.cuda.is_available() is False")
            return
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        rep.add("CUDA device", "info", value=name,
                detail=f"{props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} "
                       f"SMs, capability {props.major}.{props.minor}, "
                       f"{torch.cuda.device_count()} visible")
        rep.figure("gpu", name)
        rep.figure("gpu_memory_gib", round(props.total_memory / 2**30, 1))
        peak = peak_bf16_flops(name)
        rep.figure("peak_bf16_tflops", peak / 1e12 if peak else None)
        try:
            rep.add("NCCL", "info", value=".".join(map(str, torch.cuda.nccl.version())))
        except Exception as e:  # noqa: BLE001 - a torch without NCCL still reports the rest
            rep.error("NCCL", e)
    else:
        rep.add("CUDA device", "skip", detail="--device cpu")
    try:
        import horovod
        import horovod.torch  # noqa: F401

        rep.add("Horovod", "info", value=getattr(horovod, "__version__", "present"))
    except Exception as e:  # noqa: BLE001 - ImportError or a broken build: both mean absent
        rep.add("Horovod", "info", value="absent",
                detail=f"{type(e).__name__}: {e}"[:300] + "; ddp runs as the engine's "
                       "all-reduce (fsdp NO_SHARD) in this check")
    for name, fn in (("ceilings", _ceilings), ("mpi", _mpi)):
        try:
            fn(ctx, rep)
        except Exception as e:  # noqa: BLE001 - one item's failure must not hide the others
            rep.error(name, e)
