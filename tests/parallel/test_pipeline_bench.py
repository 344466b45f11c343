"""`hpctrain bench pipeline` runs end to end at 2 ranks on a tiny model."""

import pytest

from hpctrain.parallel.pipeline.schedule import bubble_formula
from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def test_bench_pipeline_prints_bubble_table():
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--pp", "2", "--microbatches", "2,4",
                       "--steps", "1", "--warmup", "1", "--layers", "4", "--width", "64",
                       "--micro-batch", "8", "--wait", "spin,sleep"], timeout=240)
    out = proc.stdout
    assert "pipeline bench: 2 ranks" in out and "load average" in out, out + proc.stderr
    assert "crosses a stage boundary in" in out, out
    main, _, compute = out.partition("compute per micro-batch, median ms")
    names = ("gpipe", "1f1b", "interleaved-1f1b")
    rows = [ln.split() for ln in main.splitlines() if ln.strip().split(" ")[0] in names]
    # gpipe and 1f1b at m=2,4; interleaved (v=2) at m=2,4: 6 rows.
    # both wait policies side by side
    want = sorted((s, m, w) for s in names for m in (2, 4) for w in ("spin", "sleep"))
    assert sorted((r[0], int(r[2]), r[4]) for r in rows) == want, out
    for r in rows:
        p, m, v = int(r[1]), int(r[2]), int(r[3])
        stages = [float(x) for x in r[5:5 + p]]
        mean, formula, ratio, sim, vs_sim, imbal, jitter, comm, over, ours = map(
            float, r[5 + p:15 + p])
        assert all(0.0 <= b < 1.0 for b in stages), r
        assert formula == pytest.approx(bubble_formula(p, m, v), abs=5e-4), r
        assert ratio == pytest.approx(mean / formula, abs=0.02), r
        assert 0.0 <= sim < 1.0 and imbal == pytest.approx(sim - formula, abs=2e-3), r
        assert vs_sim == pytest.approx(mean / sim, abs=0.02) if sim > 0.01 else vs_sim >= 0, r
        # the three parts add up to the excess of the measured bubble over the formula
        assert imbal + jitter + comm == pytest.approx(mean - formula, abs=3e-3), r
        assert 0.0 <= over < 1.0 and ours > 0  # samples/s
    # measured forward/backward ms of every stage (p*v of them) for each row
    cells = [ln.split() for ln in compute.splitlines() if ln.strip().split(" ")[0] in names]
    assert sorted((c[0], int(c[2]), c[4]) for c in cells) == want, out
    for c in cells:
        times = [float(t) for cell in c[5:] for t in cell.split("/")]
        assert len(times) == 2 * int(c[1]) * int(c[3]) and all(t > 0 for t in times), c
    bad = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--wait", "busy"], timeout=60,
                  check=False)  # a bad policy: one clear error, before any MPI work
    assert bad.returncode != 0 and "--wait busy is not one of spin, yield, sleep" in bad.stderr
    # torch pipelining either ran (numbers in the last columns) or the reason is printed.
    assert all(r[-1] != "-" for r in rows) or "comparison did not run:" in out, out
