"""`hpctrain bench pipeline` runs end to end at 2 ranks on a tiny model."""

import pytest

from hpctrain.parallel.pipeline.schedule import bubble_formula
from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def test_bench_pipeline_prints_bubble_table():
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--pp", "2", "--microbatches", "2,4",
                       "--steps", "1", "--warmup", "1", "--layers", "4", "--width", "64",
                       "--micro-batch", "8"], timeout=240)
    out = proc.stdout
    assert "pipeline bench: 2 ranks" in out, out + proc.stderr
    rows = [ln.split() for ln in out.splitlines()
            if ln.strip().split(" ")[0] in ("gpipe", "1f1b", "interleaved-1f1b")]
    # gpipe and 1f1b at m=2,4; interleaved (v=2) at m=2,4: 6 rows.
    assert sorted((r[0], int(r[2])) for r in rows) == sorted(
        (s, m) for s in ("gpipe", "1f1b", "interleaved-1f1b") for m in (2, 4)), out
    for r in rows:
        p, m, v = int(r[1]), int(r[2]), int(r[3])
        stages = [float(x) for x in r[4:4 + p]]
        assert all(0.0 <= b < 1.0 for b in stages), r
        assert float(r[4 + p + 1]) == pytest.approx(bubble_formula(p, m, v), abs=5e-4), r
        assert float(r[4 + p + 3]) > 0  # samples/s
    # torch pipelining either ran (numbers in the last columns) or the reason is printed.
    assert all(r[-1] != "-" for r in rows) or "comparison did not run:" in out, out
