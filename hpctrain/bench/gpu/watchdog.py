"""GPU check, part ``watchdog``: the stall watchdog on a device that completes ops late.

Two items, each in its own time-boxed process (watchdog_worker.py): ``stall``, an op queued
behind a kernel longer than the timeout, must be reported by name (the STALL line) within
timeout + poll + grace + a margin, and the process must end (the watchdog's abort), not
hang; ``behind``, ops queued behind kernels shorter than the timeout with the host one op
ahead of the device for several timeouts, must not be reported. On cpu the device is a
stand-in marker (see the worker), so the same recorder/watchdog path runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from hpctrain.bench.gpu.common import run_boxed

TIMEOUT_S = 2.0
MARGIN_S = 2.0     # on top of timeout + poll + grace: the report's own work
STARTUP_S = 8.0    # a worker's start (torch, CUDA and NCCL init) on top of what it runs
GRACE_S = 1.3      # Watchdog.grace at TIMEOUT_S (max(3 poll + 1, min(10, timeout / 2)))


def _worker(ctx, case: str, out, extra=(), limit: float | None = None
            ) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.getcwd())
    argv = [sys.executable, "-m", "hpctrain.bench.gpu.watchdog_worker", case, "--device",
            ctx.device, "--timeout", str(TIMEOUT_S), "--out", str(out), *extra]
    t0 = time.time()
    budget = max(1.0, min(ctx.left() - 1.0, limit or ctx.left()))
    return run_boxed(argv, budget, env=env), t0


def _lines(text: str, tag: str) -> list[str]:
    return [ln[len(tag) + 1:] for ln in text.splitlines() if ln.startswith(tag + " ")]


def _info(proc) -> dict:
    got = _lines(proc.stdout, "INFO")
    return json.loads(got[-1]) if got else {}


def _tail(proc) -> str:
    return (proc.stdout[-1500:] + "\n" + proc.stderr[-2500:]).strip()


def _stall(ctx, rep) -> None:
    out = ctx.scratch("watchdog") / "stall"
    # the worker's kernel outlasts the report (timeout + poll + grace) by 3 s
    need = TIMEOUT_S + GRACE_S + 4 + (3 if ctx.tiny else STARTUP_S)
    if ctx.left() < need:
        rep.add("stall behind a long kernel is reported", "skip", detail="time box")
        return
    try:
        proc, _ = _worker(ctx, "stall", out, limit=need + 8)
    except subprocess.TimeoutExpired as e:
        rep.add("stall behind a long kernel is reported", "fail",
                detail=f"the process hung past the part's time box\n{(e.stdout or '')[-800:]}"
                       f"\n{(e.stderr or '')[-1500:]}")
        return
    info = _info(proc)
    issued = [float(x) for x in _lines(proc.stdout, "ISSUED")]
    report_path = out / "stall-report.txt"
    report = report_path.read_text() if report_path.exists() else ""
    stall_line = next((ln for ln in report.splitlines() if "STALL" in ln), "")
    poll, grace = info.get("poll_s", 0.1), info.get("grace_s", 1.3)
    limit = TIMEOUT_S + poll + grace + MARGIN_S
    named = "allreduce" in stall_line and "world.nccl" in stall_line
    started = issued[0] if issued else None
    try:  # the rank's flight record, dumped at the stall: the op is still pending there
        flight = json.loads((out / "flight-rank-0.json").read_text())
        pending = [e["op"] for e in flight.get("pending", [])]
        started = flight["pending"][0]["start"]  # the op's own start, as recorded
    except (OSError, ValueError, KeyError, IndexError):
        pending = None
    after = report_path.stat().st_mtime - started if report and started else None
    ok = bool(stall_line) and named and pending == ["allreduce"] and after is not None and after <= limit \
        and proc.returncode != 0 and not _lines(proc.stdout, "NOSTALL")
    where = ("cuda: " if ctx.device == "cuda" else
             "cpu: no GPU kernel to queue behind; the marker is a stand-in whose query() turns "
             "True when the kernel would end (the recorder's marker protocol); ")
    rep.add("stall behind a long kernel is reported", "pass" if ok else "fail",
            value=round(after, 2) if after is not None else None,  # s from the op's start
            target=f"STALL naming allreduce over world.nccl within {limit:.1f} s "
                   f"(timeout {TIMEOUT_S:g} + poll + grace + {MARGIN_S:g}), process ends",
            detail=f"{where}op: {info.get('op')}; marker: {info.get('marker')}; "
                   f"exit code {proc.returncode}; pending in the dumped "
                   f"flight record: {pending}; "
                   f"STALL line: {stall_line.strip() or '(none)'}"
                   + ("" if ok else "\n" + _tail(proc)))
    if after is not None:
        rep.figure("watchdog_stall_report_s", round(after, 2))


def _behind(ctx, rep) -> None:
    out = ctx.scratch("watchdog") / "behind"
    seconds = 3 * TIMEOUT_S
    need = seconds + 2 + (3 if ctx.tiny else STARTUP_S)
    if ctx.left() < need:
        rep.add("a GPU merely behind the host is not reported", "skip", detail="time box")
        return
    try:
        proc, _ = _worker(ctx, "behind", out, ["--seconds", str(seconds)])
    except subprocess.TimeoutExpired as e:
        rep.add("a GPU merely behind the host is not reported", "fail",
                detail=f"the process hung past the part's time box\n{(e.stderr or '')[-1500:]}")
        return
    info = _info(proc)
    done = _lines(proc.stdout, "DONE")
    res = json.loads(done[-1]) if done else {}
    stalled = res.get("stall", True) or "STALL" in proc.stderr or (out / "stall-report.txt"
                                                                    ).exists()
    ok = proc.returncode == 0 and bool(res) and not stalled and res.get("still_pending") == 0 \
        and res.get("ended", 0) >= 2 and (res.get("max_pending_s") or 0) < TIMEOUT_S
    where = ("cuda" if ctx.device == "cuda" else "cpu: stand-in markers (no GPU kernel)")
    rep.add("a GPU merely behind the host is not reported", "pass" if ok else "fail",
            value=res.get("max_pending_s") and round(res["max_pending_s"], 2),
            target=f"no STALL over {seconds:g} s, ops pending < timeout {TIMEOUT_S:g} s",
            detail=f"{where}; {res.get('ops')} ops each behind a {res.get('kernel_s')} s "
                   f"kernel, host one op ahead; op: {info.get('op')}; value: the longest an "
                   f"op stayed pending (s); exit code {proc.returncode}"
                   + ("" if ok else "\n" + _tail(proc)))


def run(ctx, rep) -> None:
    if ctx.device == "cuda":
        rep.note("world size 1: communicators record nothing at size 1 (recording.py), so the "
                 "worker records its op as the wrapper records an NCCL op (RECORDER.start, "
                 "then end_on_device with the CUDA-event marker) and runs a Watchdog thread "
                 "itself (start_watchdog starts none for one rank)")
    for name, item in (("stall behind a long kernel is reported", _stall),
                       ("a GPU merely behind the host is not reported", _behind)):
        try:
            item(ctx, rep)
        except Exception as e:  # noqa: BLE001 - one item's crash must not hide the other
            rep.error(name, e)
