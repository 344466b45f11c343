"""`bench halo` runs end to end at 2 ranks on a tiny grid and prints its ratios."""

import re

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def test_bench_halo_prints_ratios():
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "halo", "--size", "64", "--channels", "4",
                       "--reps", "3", "--model-size", "16", "--base", "4", "--steps", "1",
                       "--warmup", "1", "--wide", "96"], timeout=240)
    out = proc.stdout
    assert "halo bench: 2 ranks" in out, out
    assert "1x64x16x96 fp32 field" in out, out  # the wide exchange
    for label in ("raw mpi4py Sendrecv, packed", "raw mpi4py Sendrecv, subarray in place",
                  "halo exchange (messages)", "of which outside autograd",
                  "halo exchange (+tile copy)", "1 rank, full grid",
                  "2 ranks, overlap", "2 ranks, no overlap", "overlap gain:"):
        assert label in out, out
    ratios = [float(r) for r in re.findall(r"ratio (\d+\.\d+)x", out)]
    assert len(ratios) == 6 and all(r > 0 for r in ratios), out
    assert re.search(r"\d+\.\d+x packed", out), out
