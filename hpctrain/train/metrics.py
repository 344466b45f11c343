"""Metrics: per-step CSV and the end-of-run JSON summary, both written by rank 0."""

from __future__ import annotations

import csv
import json
import os
import resource
import sys

__all__ = ["MetricsCSV", "TensorBoardWriter", "SUMMARY_NAME", "gather_peak_rss_mb", "peak_rss_mb",
           "write_summary"]

SUMMARY_NAME = "summary.json"  # the copy of the summary in out_dir, read by `hpctrain report`


class MetricsCSV:
    """One row per step in out_dir/metrics.csv (rank 0 only; other ranks no-op).

    A fresh run starts the file anew; a resumed run (``resume_step`` > 0) keeps the rows up
    to the checkpoint's step and appends after them, so a pre-empted and resumed job has one
    row per step, none twice.
    """

    # lr: the step's learning rate (before the schedule steps); grad_norm: the global norm
    # over all ranks and shards before clipping, when clipping or the non-finite guard
    # computed it (empty with train.nonfinite = ignore and no clipping); peak_rss_mb: rank
    # 0's; val_loss: the validation loss at the steps it was measured (Trainer val_every),
    # empty elsewhere.
    FIELDS = ("step", "loss", "lr", "units_per_s", "elapsed_s", "grad_norm", "peak_rss_mb",
              "val_loss")
    # Every layout this class wrote, newest first: older files are still read and resumed.
    LAYOUTS = (FIELDS, FIELDS[:7], FIELDS[:5])

    def __init__(self, out_dir: str, enabled: bool, resume_step: int = 0):
        self._fh = None
        if enabled and out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, "metrics.csv")
            kept = self._rows_up_to(resume_step) if resume_step > 0 else []
            self._fh = open(self.path, "w", newline="")
            self._writer = csv.writer(self._fh)
            self._writer.writerow(self.FIELDS)
            self._writer.writerows(kept)
            self._fh.flush()

    def _rows_up_to(self, step: int) -> list[list[str]]:
        """The existing rows of steps 1..step (a file of another layout is started anew)."""
        try:
            with open(self.path, newline="") as fh:
                rows = list(csv.reader(fh))
        except FileNotFoundError:
            return []
        if not rows or tuple(rows[0]) not in self.LAYOUTS:
            return []
        pad = [""] * (len(self.FIELDS) - len(rows[0]))
        return [r + pad for r in rows[1:] if r and r[0].isdigit() and int(r[0]) <= step]

    def write(self, **row) -> None:
        if self._fh is not None:
            self._writer.writerow([row.get(k, "") for k in self.FIELDS])
            self._fh.flush()  # rows are visible while the job runs (tail -f, monitors)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class TensorBoardWriter:
    """TensorBoard scalars per step in out_dir/tensorboard/ (rank 0 only; other ranks and a
    missing ``tensorboard`` package: no-op, the latter with one warning)."""

    def __init__(self, out_dir: str, enabled: bool):
        self._writer = None
        if not (enabled and out_dir):
            return
        try:
            # Imported here: an optional package, and `hpctrain report` loads this module torch-free.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            print(f"hpctrain: warning: no TensorBoard events ({exc}); pip install tensorboard, "
                  f"or set train.tensorboard = false", file=sys.stderr, flush=True)
            return
        self._writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))

    def write(self, step: int, scalars: dict) -> None:
        """Add each scalar of ``scalars`` at ``step`` (None: left out)."""
        if self._writer is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def gather_peak_rss_mb(comm) -> list[float]:
    """Every rank's peak RSS in MiB, in rank order; collective over ``comm``'s ranks.

    An all-gather as one sum of host scalars (each rank fills its own slot): exact, and this
    module needs no torch, so ``hpctrain report`` starts without importing it.
    """
    slots = [0.0] * comm.size
    slots[comm.rank] = peak_rss_mb()
    return comm.allreduce_scalars(slots)


def write_summary(path: str, summary: dict) -> None:
    """Write the summary JSON atomically (tmp + rename) so readers never see half a file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
