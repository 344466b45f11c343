"""The prepared GPU check (``bench gpu``) runs end to end on CPU with --tiny, so it cannot rot
between the chances to run it on a GPU; its driver reports crashes and hangs, never hides them."""

import json
import subprocess
import sys
import time

import pytest

from hpctrain.bench.gpu import check
from hpctrain.bench.gpu.common import PARTS, PartReport, run_boxed
from tests.mpirun import mpi_env, run_single


@pytest.mark.mpi
def test_gpu_check_runs_every_part_on_cpu_tiny(tmp_path):
    out = tmp_path / "check"
    proc = run_single(["-m", "hpctrain", "bench", "gpu", "--device", "cpu", "--tiny", "--out",
                       str(out)], timeout=600, check=False)
    report = json.loads((out / "report.json").read_text())
    text = (out / "report.md").read_text()
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == list(PARTS), report
    problems = [(p["part"], i["name"], i["detail"][-600:]) for p in report["parts"]
                for i in p["items"] if i["status"] in ("fail", "error")]
    assert proc.returncode == 0 and report["verdict"]["clean"], (problems, proc.stdout[-3000:])
    for name, part in parts.items():
        assert part["rc"] == 0 and part["items"], (name, part)
        assert f"## {name} (ran," in text
        # Every item that ran says what it measured; what only a GPU shows says why it skipped.
        for item in part["items"]:
            assert item["status"] != "skip" or item["detail"], (name, item)
    checked = [i for p in report["parts"] for i in p["items"] if i["status"] == "pass"]
    assert len(checked) >= 10, report  # the plans' equivalences at least
    assert proc.stdout.count("# hpctrain GPU check (cpu, tiny)") == 1


def test_report_rewritten_per_item_and_driver_kills_a_hung_part(tmp_path):
    rep = PartReport("speed", tmp_path / "speed.json")
    rep.add("a", "pass", value=1.0, target="<= 2")
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        rep.error("b", e)
    data = json.loads((tmp_path / "speed.json").read_text())
    assert [i["status"] for i in data["items"]] == ["pass", "error"]
    assert "RuntimeError: boom" in data["items"][1]["detail"]
    with pytest.raises(ValueError):
        rep.add("c", "maybe")
    # A part (and anything it started) outliving its box is killed as a group.
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_boxed(["bash", "-c", "sleep 60 & sleep 60; wait"], 1.0, env=mpi_env())
    assert time.monotonic() - t0 < 10
    report = {"device": "cuda", "tiny": False, "started": "now", "seconds": 1.0,
              "parts": [dict(data, outcome="killed at its time box (20 s)", rc=None,
                             seconds=20.0, box_s=1.0, output_tail="last words")]}
    report["verdict"] = check._verdict(report["parts"])
    assert not report["verdict"]["clean"] and not report["verdict"]["every_part_ran"]
    md = check.render_markdown(report)
    assert "| b | error |" in md and "RuntimeError: boom" in md and "last words" in md
    assert "NOT clean" in md


def test_unknown_part_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "bench", "gpu", "--device", "cpu",
                           "--tiny", "--parts", "facts,speedd", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert proc.returncode == 2 and "unknown part(s) speedd" in proc.stderr
