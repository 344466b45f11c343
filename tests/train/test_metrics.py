"""metrics.csv: a fresh run starts it, a resumed run keeps the rows up to its checkpoint."""

from hpctrain.train.metrics import MetricsCSV


def _write(out, steps, resume=0, tag="a"):
    m = MetricsCSV(str(out), True, resume_step=resume)
    for s in steps:
        m.write(step=s, loss=f"{tag}{s}", lr=0.1, units_per_s=1, elapsed_s=0)
    m.close()
    return (out / "metrics.csv").read_text().splitlines()


def test_resume_appends_after_the_checkpoint_step(tmp_path):
    _write(tmp_path, range(1, 8))                      # ran to 7, checkpoint at 5
    rows = _write(tmp_path, range(6, 11), resume=5, tag="b")
    assert rows[0] == "step,loss,lr,units_per_s,elapsed_s,grad_norm,peak_rss_mb"
    assert [r.split(",")[:2] for r in rows[1:]] == \
        [[str(s), f"a{s}"] for s in range(1, 6)] + [[str(s), f"b{s}"] for s in range(6, 11)]


def test_fresh_run_starts_anew_and_disabled_ranks_write_nothing(tmp_path):
    _write(tmp_path, range(1, 4))
    assert len(_write(tmp_path, range(1, 3), tag="c")) == 3
    MetricsCSV(str(tmp_path / "other"), False).write(step=1, loss=1, lr=1, units_per_s=1,
                                                     elapsed_s=1)
    assert not (tmp_path / "other").exists()
