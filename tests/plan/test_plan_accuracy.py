"""The estimate against a real step under mpirun: every plan the planner prices for a tiny
gpt and the bench's Linear stack, at 2 and 4 ranks (one launch each, all plans inside)."""

import re

import pytest

from tests.mpirun import run_mpi


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_priced_plan_matches_a_measured_step(ranks):
    proc = run_mpi(ranks, ["-m", "hpctrain", "bench", "plan"], timeout=240, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    cases = int(re.search(r"(\d+) cases: .*all PASS", out).group(1))
    rows = [line for line in out.splitlines() if line.rstrip().endswith(tuple("0123456789"))
            and (" PASS " in line or " FAIL " in line)]
    assert len(rows) == cases and not any("FAIL" in r for r in rows)
    # every kind of plan ran: data-parallel flavours, pipeline schedules, tensor (+sp)
    for label in ("ddp", "zero1", "zero2", "zero3", "fsdp:SHARD_GRAD_OP", "pp2:1f1b",
                  "pp2:gpipe", "tp2", "tp2+sp"):
        assert any(re.search(rf"\bgpt\s+{re.escape(label)}\b", r) for r in rows), label
    assert any(r.lstrip().startswith("stack") for r in rows)
