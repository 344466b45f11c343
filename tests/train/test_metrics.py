"""metrics.csv: a fresh run starts it, a resumed run keeps the rows up to its checkpoint;
its columns (lr, grad_norm, val_loss only at the steps validated)."""

import csv

from hpctrain.train.metrics import MetricsCSV

HEADER = "step,loss,lr,units_per_s,elapsed_s,grad_norm,peak_rss_mb,val_loss"


def _write(out, steps, resume=0, tag="a"):
    m = MetricsCSV(str(out), True, resume_step=resume)
    for s in steps:
        m.write(step=s, loss=f"{tag}{s}", lr=0.1, units_per_s=1, elapsed_s=0)
    m.close()
    return (out / "metrics.csv").read_text().splitlines()


def test_resume_appends_after_the_checkpoint_step(tmp_path):
    _write(tmp_path, range(1, 8))                      # ran to 7, checkpoint at 5
    rows = _write(tmp_path, range(6, 11), resume=5, tag="b")
    assert rows[0] == HEADER
    assert [r.split(",")[:2] for r in rows[1:]] == \
        [[str(s), f"a{s}"] for s in range(1, 6)] + [[str(s), f"b{s}"] for s in range(6, 11)]


def test_fresh_run_starts_anew_and_disabled_ranks_write_nothing(tmp_path):
    _write(tmp_path, range(1, 4))
    assert len(_write(tmp_path, range(1, 3), tag="c")) == 3
    MetricsCSV(str(tmp_path / "other"), False).write(step=1, loss=1, lr=1, units_per_s=1,
                                                     elapsed_s=1)
    assert not (tmp_path / "other").exists()


def test_val_loss_is_a_column_filled_only_at_the_steps_validated(tmp_path):
    m = MetricsCSV(str(tmp_path), True)
    for s in range(1, 5):
        m.write(step=s, loss=1.0 / s, lr=0.1 * s, units_per_s=1, elapsed_s=0,
                grad_norm=f"{2.0 * s:.8g}", val_loss=f"{0.5 / s:.8g}" if s % 2 == 0 else "")
    m.close()
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["val_loss"] for r in rows] == ["", "0.25", "", "0.125"]
    assert [r["lr"] for r in rows] == ["0.1", "0.2", "0.30000000000000004", "0.4"]
    assert [r["grad_norm"] for r in rows] == ["2", "4", "6", "8"]


def test_a_file_of_the_layout_before_val_loss_is_resumed_with_the_column_added(tmp_path):
    old = ",".join(MetricsCSV.FIELDS[:7])
    (tmp_path / "metrics.csv").write_text(f"{old}\n1,a1,0.1,1,0,3.5,100\n2,a2,0.1,1,0,3.4,100\n")
    rows = _write(tmp_path, [2, 3], resume=1, tag="b")
    assert rows == [HEADER, "1,a1,0.1,1,0,3.5,100,", "2,b2,0.1,1,0,,,", "3,b3,0.1,1,0,,,"]
