"""The memory and step benchmarks run end to end at 2 ranks on a tiny model."""

import pytest

from tests.mpirun import run_mpi


def test_bench_memory_prints_ratios():
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "memory", "--params-m", "0.05", "--steps", "1",
                       "--strategies", "single,zero1,zero3,fsdp,fsdp2"], timeout=240)
    out = proc.stdout
    assert "memory bench:" in out and "2 ranks" in out, out
    # Table rows: strategy, train peak MB, formula MB, measured/formula, build peak MB.
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()
            if ln.startswith("  ") and len(ln.split()) >= 5 and ln.split()[1][0].isdigit()}
    assert sorted(rows) == ["fsdp", "fsdp2", "zero1", "zero3"], out  # single: 1-rank runs only
    for cells in rows.values():
        assert float(cells[1]) > 0 and float(cells[3]) > 0, out
    assert "peak memory zero3/fsdp2 =" in out
    assert "zero3 memory_report MB:" in out and "x formula" in out
    assert "fsdp memory_report MB:" in out and "peak memory fsdp/fsdp2 =" in out


def test_bench_step_prints_ratio():
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "step", "--params-m", "0.05", "--steps", "2",
                       "--warmup", "1", "--batch", "4", "--strategies", "zero3,fsdp,fsdp2"],
                   timeout=240)
    out = proc.stdout
    assert "step bench:" in out and "median of 2 steps" in out, out
    assert "step time zero3/fsdp2 =" in out and "step time fsdp/fsdp2 =" in out, out


def test_bench_rejects_unknown_strategy():
    from hpctrain.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "step", "--strategies", "zero4"])


def test_bench_checkpoint_state_is_the_size_asked_for():
    from hpctrain.bench.checkpoint import _model

    for mb in (1, 8, 65, 200):
        nbytes = sum(t.numel() * t.element_size() for t in _model(mb).state_dict().values())
        assert mb * 2**20 * 0.99 <= nbytes <= mb * 2**20, (mb, nbytes)
