"""The memory and step benchmarks run end to end at 2 ranks on a tiny model."""

import json
import re

import pytest

from tests.mpirun import run_mpi


@pytest.mark.mpi
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


_RATIO = re.compile(r"^  step time (\S+)/(\S+) = ([\d.]+)x  \((?:target <= ([\d.]+), "
                    r"([^)]+)\)  (PASS|MISS)|no target\))$")


def _step_table(out: str) -> dict:
    """{strategy: (median ms, [step ms...])} from the printed table."""
    rows, on = {}, False
    for ln in out.splitlines():
        if ln.startswith("  strategy ") and "median ms" in ln:
            on = True
        elif on and (m := re.match(r"^  (\S+) +([\d.]+)   \(([\d ]+)\)$", ln)):
            rows[m[1]] = (float(m[2]), [float(t) for t in m[3].split()])
        elif on:
            on = False
    return rows


def _check_step_report(out: str, data: dict, names) -> None:
    """The text names every entry, each with positive times; every ratio line carries its
    target and verdict and agrees with the JSON, which holds the same medians."""
    rows = _step_table(out)
    assert list(rows) == list(names) == list(data["strategies"]), out
    for s, (median_ms, steps_ms) in rows.items():
        assert median_ms > 0 and all(t >= 0 for t in steps_ms), out
        assert len(steps_ms) == data["steps"] == len(data["strategies"][s]["step_s"]), out
        assert f"{data['strategies'][s]['median_s'] * 1e3:.1f}" == f"{median_ms:.1f}", out
    printed = {m[1] + "/" + m[2]: m for m in map(_RATIO.match, out.splitlines()) if m}
    assert sorted(printed) == sorted(d["name"] for d in data["ratios"]), out
    for d in data["ratios"]:
        m = printed[d["name"]]
        assert d["value"] > 0 and f"{d['value']:.2f}" == m[3], (d, out)
        num, den = data["strategies"][d["numerator"]], data["strategies"][d["baseline"]]
        assert d["value"] == pytest.approx(num["median_s"] / den["median_s"])
        if d["target"] is None:
            assert m[4] is None and d["pass"] is None, out
        else:
            assert float(m[4]) == d["target"] and m[5] == d["kind"], out
            assert m[6] == ("PASS" if d["pass"] else "MISS"), out
    for d in data["skipped"]:
        assert f"  step time {d['name']}: skipped, {d['reason']}" in out.splitlines(), out


@pytest.mark.mpi
def test_bench_step_baselines_ratios_and_json(tmp_path):
    # One entry per baseline and per targeted ratio: each entry is a fresh spawn (seconds);
    # zero1-3, fsdp and fsdp2 run through the same workload in test_bench_memory_prints_ratios.
    names = ["nocomm", "torchddp", "ddp", "fsdp:NO_SHARD"]
    path = tmp_path / "step.json"
    proc = run_mpi(2, ["-m", "hpctrain", "bench", "step", "--params-m", "0.1", "--width", "128",
                       "--steps", "2", "--warmup", "1", "--batch", "4", "--strategies",
                       ",".join(names).replace("NO_SHARD", "no_shard"), "--json", str(path)],
                   timeout=300)
    out = proc.stdout
    assert "step bench:" in out and "median of 2 steps" in out and "2 ranks" in out, out
    data = json.loads(path.read_text())
    _check_step_report(out, data, names)
    assert {d["name"]: d["target"] for d in data["ratios"]} == {
        "ddp/torchddp": 1.0, "fsdp:NO_SHARD/torchddp": 1.0, "fsdp:NO_SHARD/ddp": 1.05,
        "ddp/nocomm": 1.1}, out
    assert data["skipped"] == [] and data["ranks"] == 2 and data["layers"] == 6, out


def test_bench_step_report_skips_ratios_without_baseline():
    from hpctrain.bench.step import report

    res = {s: {"median_s": t, "step_s": [t, t], "psi": 99072, "layers": 6, "width": 128,
               "mmap_threshold_kb": 0}
           for s, t in (("zero1", 0.02), ("zero3", 0.03), ("fsdp", 0.04), ("torchddp", 0.025),
                        ("fsdp:NO_SHARD", 0.01))}
    lines, data = report(res, 2, 4, 2, 1, 0.5)
    out = "\n".join(lines)
    _check_step_report(out, data, list(res))
    assert [d["name"] for d in data["ratios"]] == [
        "zero1/torchddp", "zero3/torchddp", "fsdp/torchddp", "fsdp:NO_SHARD/torchddp"]
    assert [d["pass"] for d in data["ratios"]] == [True, False, False, True]
    assert [(d["name"], d["reason"]) for d in data["skipped"]] == [
        ("fsdp:NO_SHARD/ddp", "baseline ddp not run"),
        ("zero1/nocomm", "baseline nocomm not run"),
        ("zero3/fsdp2", "baseline fsdp2 not run"),
        ("fsdp/fsdp2", "baseline fsdp2 not run")]
    # A baseline alone gives no ratio and no skip line; nothing is invented.
    lines, data = report({"torchddp": res["torchddp"]}, 2, 4, 2, 1, 0.5)
    assert data["ratios"] == [] and data["skipped"] == [] and "step time" not in "\n".join(lines)


def test_bench_step_strategy_spellings():
    from hpctrain.bench.step import DEFAULT
    from hpctrain.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "step"]).strategies == DEFAULT == (
        "nocomm", "torchddp", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp:NO_SHARD",
        "pp2:ddp", "pp2:zero3")
    args = parse(["bench", "step", "--strategies", "ddp,fsdp:full_shard,fsdp:shard_grad_op,"
                  "FSDP:NO_SHARD,fsdp2,torchddp,nocomm,zero1,zero2,zero3,fsdp,PP2:zero2",
                  "--json", "x"])
    assert args.strategies == ("ddp", "fsdp", "fsdp:SHARD_GRAD_OP", "fsdp:NO_SHARD", "fsdp2",
                               "torchddp", "nocomm", "zero1", "zero2", "zero3", "pp2:zero2")
    assert args.json_path == "x"
    for bad in ("fsdp:HALF_SHARD", ",", "torch", "ddp,zero4"):
        with pytest.raises(SystemExit):
            parse(["bench", "step", "--strategies", bad])


def test_bench_rejects_unknown_strategy():
    from hpctrain.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "step", "--strategies", "zero4"])


def test_bench_checkpoint_state_is_the_size_asked_for():
    from hpctrain.bench.checkpoint import _model

    for mb in (1, 8, 65, 200):
        nbytes = sum(t.numel() * t.element_size() for t in _model(mb).state_dict().values())
        assert mb * 2**20 * 0.99 <= nbytes <= mb * 2**20, (mb, nbytes)


@pytest.mark.parametrize("name, device, share, step_s, verdict", [
    ("medium", "cpu", 0.002, 0.06, " PASS"),
    ("medium", "cpu", 0.011, 0.06, " FAIL"),
    ("medium", "cpu", 0.002, 0.03, " NO VERDICT: the step is 30 ms, under 50 ms (raise --batch)"),
    ("tiny", "cpu", 0.12, 0.005, " (information)"),
    ("gpu", "cuda", 0.002, 0.08, " PASS"),
    ("medium", "cuda", 0.002, 0.06, " (information)"),
])
def test_bench_flight_judges_only_the_budget_step(name, device, share, step_s, verdict):
    """The 1% budget is set on a realistic step (medium on CPU, gpu on a GPU, >= 50 ms)."""
    from hpctrain.bench.flight import _verdict

    assert _verdict(name, device, share, step_s) == verdict
