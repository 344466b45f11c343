"""The GPU check's driver: run every part in its own time-boxed process, then write
``report.json`` and ``report.md`` to the output directory whatever happened.

A part that crashes or outlives its box is killed (its process group: MPI ranks too) and
reported as such, with what it had written so far and the end of its output; the next
part still runs. The exit code is 0 only when every part ran to its end and no item
failed or crashed: a report is always written, but a check that found a fault never
passes for a clean one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpctrain.bench.gpu.common import PARTS, run_boxed

__all__ = ["BUDGET_S", "run", "render_markdown"]

#: each part's time box on a GPU, seconds (the issue's whole check: at most 8 minutes)
BUDGET_S = {"facts": 25, "speed": 100, "plans": 140, "memory": 105, "watchdog": 40,
            "overlap": 55}
TINY_BUDGET_S = 60  # every part on --device cpu --tiny (each takes seconds)


def _part(out: Path, part: str, device: str, tiny: bool, seconds: float, env: dict) -> dict:
    """Run one part in a fresh process; return its report dict with the driver's record."""
    argv = [sys.executable, "-m", "hpctrain.bench.gpu.common", part, "--out", str(out),
            "--device", device, "--seconds", str(seconds)] + (["--tiny"] if tiny else [])
    t0 = time.monotonic()
    # A grace period past the part's own box: the part skips what no longer fits and
    # writes its report; only a hang reaches the kill.
    try:
        res = run_boxed(argv, seconds + 20, env=env)
        rc, stdout, stderr, outcome = res.returncode, res.stdout, res.stderr, (
            "ran" if res.returncode == 0 else f"exit {res.returncode}")
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr, outcome = None, e.output or "", e.stderr or "", (
            f"killed at its time box ({seconds + 20:.0f} s)")
    (out / f"{part}.log").write_text(f"$ {' '.join(argv)}\n--- stdout\n{stdout}\n"
                                     f"--- stderr\n{stderr}\n")
    path = out / f"{part}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"part": part, "items": [], "notes": [], "figures": {}}
    data.update(outcome=outcome, rc=rc, seconds=round(time.monotonic() - t0, 1),
                box_s=seconds)
    if rc != 0:
        data["output_tail"] = (stdout[-1500:] + "\n" + stderr[-3000:]).strip()
    return data


def _verdict(parts: list[dict]) -> dict:
    """Counts of item statuses and whether the check is clean (every part ran, no item
    failed or crashed)."""
    counts: dict = {}
    for p in parts:
        for item in p["items"]:
            counts[item["status"]] = counts.get(item["status"], 0) + 1
    ran = all(p["rc"] == 0 for p in parts)
    clean = ran and not counts.get("fail") and not counts.get("error")
    return {"counts": counts, "every_part_ran": ran, "clean": clean}


def _cell(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict) -> str:
    """The report as markdown: the headline figures, then one table per part."""
    figs = {}
    for p in report["parts"]:
        figs.update(p.get("figures", {}))
    v = report["verdict"]
    lines = [f"# hpctrain GPU check ({report['device']}{', tiny' if report['tiny'] else ''})",
             "", f"{report['started']}, {report['seconds']:.0f} s in all. Verdict: "
             f"{'clean' if v['clean'] else 'NOT clean'}; items: "
             + ", ".join(f"{n} {k}" for k, n in sorted(v["counts"].items())), ""]
    if figs:
        lines += ["| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {_cell(val)} |" for k, val in figs.items()]
        lines.append("")
    for p in report["parts"]:
        lines += [f"## {p['part']} ({p['outcome']}, {p['seconds']:.0f} s of {p['box_s']:.0f})",
                  "", "| item | status | value | target | detail |",
                  "| --- | --- | --- | --- | --- |"]
        for item in p["items"]:
            detail = _cell(item.get("detail"))
            if item["status"] == "error":  # a traceback: its last line says what broke
                detail = _cell(((item.get("detail") or "").strip().splitlines() or [""])[-1])
            lines.append(f"| {_cell(item['name'])} | {item['status']} | {_cell(item['value'])} "
                         f"| {_cell(item['target'])} | {detail[:300]} |")
        for note in p.get("notes", []):
            lines.append(f"\n- {note}")
        if p.get("output_tail"):
            tail = "\n".join(p["output_tail"].splitlines()[-8:])
            lines += ["", "```", tail, "```"]
        lines.append("")
    return "\n".join(lines)


def run(out: str, device: str = "cuda", tiny: bool = False, parts=PARTS,
        scale: float = 1.0) -> int:
    """Run the parts in order; write out/report.json and out/report.md; print the markdown.
    ``scale`` multiplies every time box (a slower machine, or a shorter rerun)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"hpctrain: error: unknown part(s) {', '.join(unknown)}; expected some of "
              f"{', '.join(PARTS)}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.monotonic()
    results = []
    for part in parts:
        box = (TINY_BUDGET_S if tiny else BUDGET_S[part]) * scale
        print(f"hpctrain: gpu check: {part} (time box {box:.0f} s) ...", flush=True)
        results.append(_part(out_dir, part, device, tiny, box, env))
        report = {"device": device, "tiny": tiny, "started": started,
                  "seconds": time.monotonic() - t0, "parts": results,
                  "verdict": _verdict(results)}
        # Rewritten after every part: a check killed from outside still leaves a report.
        (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / "report.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0 if report["verdict"]["clean"] else 1
