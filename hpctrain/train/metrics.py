"""Metrics: per-step CSV and the end-of-run JSON summary, both written by rank 0."""

from __future__ import annotations

import csv
import json
import os
import resource
import sys

__all__ = ["MetricsCSV", "peak_rss_mb", "write_summary"]


class MetricsCSV:
    """Append one row per step to out_dir/metrics.csv (rank 0 only; other ranks no-op)."""

    FIELDS = ("step", "loss", "lr", "units_per_s", "elapsed_s")

    def __init__(self, out_dir: str, enabled: bool):
        self._fh = None
        if enabled and out_dir:
            os.makedirs(out_dir, exist_ok=True)
            self.path = os.path.join(out_dir, "metrics.csv")
            self._fh = open(self.path, "w", newline="")
            self._writer = csv.writer(self._fh)
            self._writer.writerow(self.FIELDS)

    def write(self, **row) -> None:
        if self._fh is not None:
            self._writer.writerow([row[k] for k in self.FIELDS])
            self._fh.flush()  # rows are visible while the job runs (tail -f, monitors)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def write_summary(path: str, summary: dict) -> None:
    """Write the summary JSON atomically (tmp + rename) so readers never see half a file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
