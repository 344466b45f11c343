"""report.png: drawn from a run's files, overlaid for several runs, written at the end of train."""

import json
import math
import os
import struct
import subprocess
import sys

import pytest

from hpctrain.cli import main
from hpctrain.train.metrics import SUMMARY_NAME, MetricsCSV, write_summary
from hpctrain.train.report import draw_report, report_after_training
from hpctrain.train.report_runs import ReportError, differences, load_run, load_runs, title_of
from tests.mpirun import ROOT, run_mpi, run_single, together

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(out_dir, losses, strategy="single", world_size=1, peaks=(350.0,), first_step=1,
               summary=True, val_every=0, lr=0.01, batch=32, norms=True, clip=0.0, **settings):
    """A run directory as train leaves it: metrics.csv (8 digits) and summary.json."""
    m = MetricsCSV(str(out_dir), True)
    val = []
    for i, loss in enumerate(losses):
        step = first_step + i
        if val_every and step % val_every == 0:
            val.append([step, loss + 0.05])
        m.write(step=step, loss=f"{loss:.8g}", lr=lr * min(1.0, step / 3),
                units_per_s=1000.0 + 10 * i, elapsed_s=0.1 * i,
                grad_norm=f"{5.0 / step:.8g}" if norms else "",
                val_loss=f"{val[-1][1]:.8g}" if val and val[-1][0] == step else "")
    m.close()
    if summary:
        write_summary(str(out_dir / SUMMARY_NAME), dict({
            "strategy": strategy, "world_size": world_size, "model": "gpt", "unit": "tokens",
            "losses": list(losses), "final_loss": losses[-1], "global_batch_size": batch,
            "grad_accum": 1, "lr": lr, "lr_schedule": "constant", "max_grad_norm": clip,
            "precision": "fp32", "seed": 0, "val_losses": val,
            "peak_rss_mb": max(peaks), "peak_rss_mb_per_rank": list(peaks)}, **settings))
    return str(out_dir)


def _png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR; fails unless the file is a PNG."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


LOSSES = [4.0 - 0.1 * i for i in range(12)]


def test_one_run_is_two_rows_of_three_panels(tmp_path):
    run = _write_run(tmp_path / "a", LOSSES, "zero3", 2, peaks=(351.5, 349.0), val_every=4,
                     clip=1.0)
    out = draw_report([load_run(run)], str(tmp_path / "a" / "report.png"))
    w, h = _png_size(out)
    assert 1.6 < w / h < 2.2 and 20_000 < os.path.getsize(out) < 2_000_000
    assert not os.path.exists(out + ".tmp")
    assert title_of([load_run(run)]) == "zero3 · gpt · 2 ranks · final loss 2.9"


def test_three_runs_overlay_in_a_grid_with_the_loss_difference(tmp_path):
    single = _write_run(tmp_path / "single", LOSSES)
    zero3 = _write_run(tmp_path / "zero3", [v + 3e-7 for v in LOSSES], "zero3", 2, (340, 341))
    pipe = _write_run(tmp_path / "pipe", LOSSES, "pipeline+ddp", 4, (300, 301, 302, 303))
    runs = load_runs([single, zero3, pipe])
    w, h = _png_size(draw_report(runs, str(tmp_path / "overlay.png")))
    assert 0.9 < w / h < 1.3  # 3 rows x 2 axes, not the single run's 2 x 3
    assert title_of(runs) == ("gpt: single (1 rank) vs zero3 (2 ranks) vs pipeline+ddp "
                              "(4 ranks) · max |Δ final loss| 3e-07")


def test_lr_grad_norm_and_validation_are_read_per_step(tmp_path):
    run = load_run(_write_run(tmp_path / "a", LOSSES[:6], val_every=3, norms=False))
    assert run.lrs == pytest.approx([0.01 / 3, 0.02 / 3, 0.01, 0.01, 0.01, 0.01])
    assert run.grad_norms == [None] * 6  # nothing computed it: empty cells
    assert run.val_steps == [3, 6]
    assert run.val_losses == pytest.approx([LOSSES[2] + 0.05, LOSSES[5] + 0.05])
    _png_size(draw_report([run], str(tmp_path / "r.png")))  # an empty grad-norm panel
    again = load_run(_write_run(tmp_path / "b", LOSSES[:4]))
    assert again.grad_norms == pytest.approx([5.0, 2.5, 5 / 3, 1.25]) and again.val_steps == []
    # train.nonfinite = skip records the skipped step's norm as it was: NaN, not drawn
    path = tmp_path / "b" / "metrics.csv"
    path.write_text(path.read_text().replace(",2.5,", ",nan,"))
    again = load_run(str(tmp_path / "b"))
    assert math.isnan(again.grad_norms[1]) and again.grad_norms[0] == 5.0
    _png_size(draw_report([again], str(tmp_path / "nan.png")))


def test_validation_of_a_file_without_the_column_comes_from_the_summary(tmp_path):
    run = _write_run(tmp_path / "a", LOSSES[:4], val_every=2)
    path = tmp_path / "a" / "metrics.csv"
    rows = path.read_text().splitlines()
    path.write_text("\n".join(r.rsplit(",", 1)[0] for r in rows) + "\n")  # 7 columns
    got = load_run(run)
    assert (got.val_steps, got.val_losses) == ([2, 4], [LOSSES[1] + 0.05, LOSSES[3] + 0.05])


def test_runs_that_differ_in_setup_say_how_one_line_each(tmp_path, capsys):
    a = _write_run(tmp_path / "a", LOSSES, "single", 1)
    b = _write_run(tmp_path / "b", LOSSES[:8], "zero3", 2, lr=0.02, batch=64, seed=5)
    c = _write_run(tmp_path / "c", LOSSES, "single", 1, summary=False)
    out = str(tmp_path / "cmp.png")
    assert main(["report", a, b, c, "-o", out]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "hpctrain report: runs differ in steps: single 1-12, zero3 1-8, c 1-12; "
        "|Δ loss| is drawn at the steps both runs have",
        "hpctrain report: runs differ in strategy: single on 1 rank, zero3 on 2 ranks, c ?",
        "hpctrain report: runs differ in global batch: single 32, zero3 64, c ?",
        "hpctrain report: runs differ in lr: single 0.01, zero3 0.02, c 0.01",
        "hpctrain report: runs differ in seed: single 0, zero3 5, c ?",
        f"hpctrain: report {out}"]
    runs = load_runs([a, b])
    assert title_of(runs) == ("gpt: single (1 rank) vs zero3 (2 ranks) · max |Δ loss at the "
                              "last shared step| 0")
    assert differences(load_runs([a, a])) == []


def test_labels_replace_strategies_and_the_path_is_printed(tmp_path, capsys):
    dirs = [_write_run(tmp_path / n, LOSSES) for n in ("a", "b", "c")]
    out = str(tmp_path / "cmp.png")
    assert main(["report", *dirs, "--labels", "fp32, bf16,fp16", "-o", out]) == 0
    assert capsys.readouterr().out == f"hpctrain: report {out}\n"
    _png_size(out)
    assert [r.label for r in load_runs(dirs, ["x", "y", "z"])] == ["x", "y", "z"]


def test_one_directory_redraws_its_report_in_place(tmp_path, capsys):
    run = _write_run(tmp_path / "run", LOSSES)
    assert main(["report", run]) == 0
    assert capsys.readouterr().out == f"hpctrain: report {run}/report.png\n"
    _png_size(os.path.join(run, "report.png"))


def test_losses_come_at_full_precision_from_the_summary(tmp_path):
    exact = [3.0 + 1e-12 * i for i in range(5)]  # equal to 8 digits in metrics.csv
    run = load_run(_write_run(tmp_path / "a", exact))
    assert run.losses == exact and run.steps == [1, 2, 3, 4, 5]


def test_a_run_without_summary_is_named_by_its_directory(tmp_path):
    run = load_run(_write_run(tmp_path / "old-run", LOSSES, summary=False))
    assert (run.label, run.model, run.peak_rss_mb_per_rank) == ("old-run", "?", [])
    _png_size(draw_report([run], str(tmp_path / "r.png")))


def _missing(tmp):
    return [str(tmp / "missing")]


def _no_metrics(tmp):
    return [str(tmp)]


def _disjoint_steps(tmp):
    return [_write_run(tmp / "a", LOSSES), _write_run(tmp / "b", LOSSES, first_step=100)]


def _labels_short(tmp):
    return [_write_run(tmp / "a", LOSSES)] * 2 + ["--labels", "only-one"]


def _no_rows(tmp):
    MetricsCSV(str(tmp / "c"), True).close()  # the header of a run that never finished a step
    return [str(tmp / "c")]


def _half_summary(tmp):
    run = _write_run(tmp / "a", LOSSES)
    (tmp / "a" / SUMMARY_NAME).write_text("{half")
    return [run]


def _garbled_row(tmp):
    run = _write_run(tmp / "a", LOSSES, summary=False)
    with open(tmp / "a" / "metrics.csv", "a") as fh:
        fh.write("13,oops,0.01,1000,1.3\n")
    return [run]


@pytest.mark.parametrize("make_args, words", [
    (_missing, "missing: no such directory"),
    (_no_metrics, "no metrics.csv in it"),
    (_disjoint_steps, "(steps 100-111) shares no step with"),
    (_labels_short, "--labels gives 1 name(s) for 2 run directories"),
    (_no_rows, "no steps recorded yet"),
    (_half_summary, "summary.json: not valid JSON"),
    (_garbled_row, "metrics.csv: a row that is not numbers"),
])
def test_unusable_runs_are_one_line_and_exit_2(tmp_path, capsys, make_args, words):
    out = tmp_path / "x.png"
    assert main(["report", *make_args(tmp_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpctrain report: error: ") and words in err[0], err
    assert not out.exists()


def test_after_training_a_failed_picture_is_one_warning(tmp_path, capsys, monkeypatch):
    run = _write_run(tmp_path / "a", LOSSES)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    assert report_after_training(run) is None
    warning = capsys.readouterr().out
    assert warning.startswith("hpctrain: warning: no report (") and "pip install matplotlib" in warning
    monkeypatch.undo()
    assert report_after_training(str(tmp_path / "nothing-here")) is None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "ReportError" in out[0] and "no such directory" in out[0]
    assert sorted(os.listdir(tmp_path / "a")) == ["metrics.csv", SUMMARY_NAME]


def test_importing_the_cli_and_report_leaves_matplotlib_unloaded():
    code = ("import sys, hpctrain.cli, hpctrain.train.report; "
            "sys.exit('matplotlib' in sys.modules or 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode == 0


# ---- real runs: one process, then two ranks under zero3, then the overlay of both ----------

def _check_trained_run(proc, out_dir, ranks):
    report = out_dir / "report.png"
    assert f"hpctrain: report {report}" in proc.stdout.splitlines(), proc.stdout
    _png_size(report)
    summary = json.loads((out_dir / SUMMARY_NAME).read_text())
    peaks = summary["peak_rss_mb_per_rank"]
    assert len(peaks) == ranks and all(p > 50 for p in peaks)
    assert summary["peak_rss_mb"] == max(peaks)
    return summary


def test_train_writes_the_report_on_one_and_two_ranks_and_they_overlay(tmp_path, capsys):
    common = ["-m", "hpctrain", "train", "--steps", "5", "--progress", "off"]
    # the one-process run beside the 2-rank one (independent): one core less idle
    single, zero3 = together(
        lambda: run_single(common + ["--out-dir", str(tmp_path / "single")]),
        lambda: run_mpi(2, common + ["--strategy", "zero3", "--out-dir", str(tmp_path / "zero3")]))
    s1 = _check_trained_run(single, tmp_path / "single", 1)
    s2 = _check_trained_run(zero3, tmp_path / "zero3", 2)
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)
    out = tmp_path / "overlay.png"
    assert main(["report", str(tmp_path / "single"), str(tmp_path / "zero3"), "-o", str(out)]) == 0
    assert [r.label for r in load_runs([str(tmp_path / "single"), str(tmp_path / "zero3")])] \
        == ["single", "zero3"]
    _png_size(out)


def test_report_switched_off_still_leaves_the_summary(tmp_path):
    proc = run_single(["-m", "hpctrain", "train", "--steps", "2", "--progress", "off",
                       "--model", "mlp", "--set", "train.report=false",
                       "--out-dir", str(tmp_path / "out")])
    assert sorted(os.listdir(tmp_path / "out")) == ["metrics.csv", SUMMARY_NAME, "tensorboard"]
    assert "hpctrain: report" not in proc.stdout


def test_no_out_dir_means_no_files(tmp_path):
    with pytest.raises(ReportError):
        load_run(str(tmp_path))
    proc = run_single(["-m", "hpctrain", "train", "--steps", "2", "--progress", "off",
                       "--model", "mlp", "--out-dir", ""], cwd=str(tmp_path))
    assert os.listdir(tmp_path) == [] and "hpctrain: report" not in proc.stdout
