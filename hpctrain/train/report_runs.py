"""The runs a report draws, read from their out_dirs, and what sets them apart, in words.

``load_run`` reads only the files a run leaves in its out_dir (metrics.csv and summary.json)
into a ``Run``; ``title_of`` says in one line what ran and where the loss ended, and
``differences`` names each setting in which overlaid runs differ (steps, strategy and ranks,
model, global batch, lr...), so a gap between curves is not mistaken for a bug. No
matplotlib and no torch here: report.py draws.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field

from hpctrain.train.metrics import SUMMARY_NAME, MetricsCSV

__all__ = ["ReportError", "Run", "differences", "load_run", "load_runs",
           "steps_shared_with_first", "title_of"]


class ReportError(ValueError):
    """A run cannot be drawn; the message names the directory and what is missing."""


@dataclass
class Run:
    """One run as its out_dir records it: the per-step columns and the summary's facts.

    ``lrs`` and ``grad_norms`` hold None at steps without a value; ``val_steps`` /
    ``val_losses`` are the validations (metrics.csv's val_loss, else summary.json's);
    ``settings`` is the summary itself (strategy, global_batch_size, lr, ...), {} without one.
    """

    out_dir: str
    label: str
    steps: list[int]
    losses: list[float]
    units_per_s: list[float]
    model: str
    world_size: int | None
    unit: str
    peak_rss_mb_per_rank: list[float]
    lrs: list[float | None] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def ranks_text(self) -> str:
        if self.world_size is None:
            return "? ranks"
        return f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"

    @property
    def steps_text(self) -> str:
        """'1-12': the first and last step recorded."""
        return f"{min(self.steps)}-{max(self.steps)}"

    @property
    def strategy_text(self) -> str | None:
        """'zero3 on 2 ranks'; None when the files record neither."""
        name = self.settings.get("strategy")
        if name is None and self.world_size is None:
            return None
        return f"{name or '?'} on {self.ranks_text}"

    @property
    def lr_text(self) -> str | None:
        """train.lr from the summary, else (a summary without it) the peak of metrics.csv's lr."""
        if self.settings.get("lr") is not None:
            return f"{self.settings['lr']:g}"
        finite = [v for v in self.lrs if v is not None and math.isfinite(v)]
        return f"{max(finite):g}" if finite else None

    @property
    def clip_text(self) -> str | None:
        """The gradient clipping threshold, "off", or None when not recorded."""
        clip = self.settings.get("max_grad_norm")
        return None if clip is None else (f"{clip:g}" if clip else "off")


def load_run(out_dir: str, label: str | None = None) -> Run:
    """Read a run's metrics.csv and summary.json (optional); raise ReportError if unusable.

    Without a label the run is called by its strategy (plan name) from the summary, else
    by its directory's name.
    """
    rows = _read_metrics(out_dir)
    summary = _read_summary(out_dir)
    try:
        steps = [int(r["step"]) for r in rows]
        losses = _losses(rows, steps, summary.get("losses"))
        units_per_s = [float(r["units_per_s"]) for r in rows]
        lrs = [_number(r.get("lr")) for r in rows]
        grad_norms = [_number(r.get("grad_norm")) for r in rows]
        val_steps, val_losses = _validations(rows, steps, summary.get("val_losses"))
    except (TypeError, ValueError) as exc:
        raise ReportError(f"{os.path.join(out_dir, 'metrics.csv')}: a row that is not numbers "
                          f"({exc}); was the file edited?") from None
    return Run(
        out_dir=out_dir,
        label=label or summary.get("strategy") or os.path.basename(os.path.abspath(out_dir)),
        steps=steps,
        losses=losses,
        units_per_s=units_per_s,
        model=summary.get("model") or "?",
        world_size=summary.get("world_size"),
        unit=summary.get("unit") or "units",
        peak_rss_mb_per_rank=list(summary.get("peak_rss_mb_per_rank") or []),
        lrs=lrs,
        grad_norms=grad_norms,
        val_steps=val_steps,
        val_losses=val_losses,
        settings=summary,
    )


def load_runs(out_dirs: list[str], labels: list[str] | None = None) -> list[Run]:
    """load_run for each directory; ``labels`` (one per directory) replace the strategies."""
    if labels is not None and len(labels) != len(out_dirs):
        raise ReportError(f"--labels gives {len(labels)} name(s) for {len(out_dirs)} run "
                          f"director{'y' if len(out_dirs) == 1 else 'ies'}; give one per run")
    return [load_run(d, labels[i] if labels else None) for i, d in enumerate(out_dirs)]


def _read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.csv")
    if not os.path.isfile(path):
        why = "no such directory" if not os.path.isdir(out_dir) else "no metrics.csv in it"
        raise ReportError(f"{out_dir}: {why}; give the --out-dir of a run (it writes "
                          f"metrics.csv there unless --out-dir \"\")")
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if tuple(reader.fieldnames or ()) not in MetricsCSV.LAYOUTS:
            raise ReportError(f"{path}: columns {reader.fieldnames}, expected "
                              f"{','.join(MetricsCSV.FIELDS)}; not a metrics file of hpctrain")
        rows = list(reader)
    if not rows:
        raise ReportError(f"{path}: no steps recorded yet; nothing to draw")
    return rows


def _number(text: str | None) -> float | None:
    """A CSV cell as a float ("nan", "inf" too); an empty cell (or a column the file lacks)
    is None."""
    return float(text) if text not in (None, "") else None


def _losses(rows: list[dict], steps: list[int], full: list | None) -> list[float]:
    """The loss of each step: the summary's full-precision value where it has one (its
    losses[i] is step i + 1), else the CSV's 8 digits, which would hide differences
    below ~1e-7 in the overlay."""
    full = full or []
    return [float(full[s - 1]) if 0 < s <= len(full) and full[s - 1] is not None
            else float(r["loss"]) for s, r in zip(steps, rows)]


def _validations(rows: list[dict], steps: list[int], summary_val: list | None):
    """(steps, losses) of the validations: metrics.csv's val_loss cells, else (a file
    without that column) the summary's [step, loss] pairs."""
    pairs = [(s, float(r["val_loss"])) for s, r in zip(steps, rows) if r.get("val_loss")]
    if not pairs and summary_val:
        pairs = [(int(s), float(v)) for s, v in summary_val]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _read_summary(out_dir: str) -> dict:
    """The run's summary.json, or {} when it has none (a run stopped before the end)."""
    path = os.path.join(out_dir, SUMMARY_NAME)
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not valid JSON ({exc}); delete it to draw without it")


def steps_shared_with_first(runs: list[Run]) -> list[list[int]]:
    """For each run after the first, the steps both it and the first recorded; ReportError
    when a run shares none (nothing to compare)."""
    first = set(runs[0].steps)
    shared = []
    for run in runs[1:]:
        both = sorted(first.intersection(run.steps))
        if not both:
            raise ReportError(
                f"{run.out_dir} (steps {run.steps_text}) shares no step with "
                f"{runs[0].out_dir} (steps {runs[0].steps_text}); overlay runs of the same steps")
        shared.append(both)
    return shared


def title_of(runs: list[Run]) -> str:
    """One line: what ran (plan name, model, ranks) and where the loss ended (for overlaid
    runs of different lengths: at the last step each shares with the first run)."""
    if len(runs) == 1:
        r = runs[0]
        return f"{r.label} · {r.model} · {r.ranks_text} · final loss {r.final_loss:.6g}"
    models = " / ".join(dict.fromkeys(r.model for r in runs))
    who = " vs ".join(f"{r.label} ({r.ranks_text})" for r in runs)
    ref = dict(zip(runs[0].steps, runs[0].losses))
    spread = max(abs(dict(zip(r.steps, r.losses))[both[-1]] - ref[both[-1]])
                 for r, both in zip(runs[1:], steps_shared_with_first(runs)))
    same_end = all(r.steps[-1] == runs[0].steps[-1] for r in runs)
    what = "final loss" if same_end else "loss at the last shared step"
    return f"{models}: {who} · max |Δ {what}| {spread:.2g}"


# What `differences` compares, in order: (name, the run's value as text, or None if unknown).
SETTINGS = (
    ("steps", lambda r: r.steps_text),
    ("strategy", lambda r: r.strategy_text),
    ("model", lambda r: None if r.model == "?" else r.model),
    ("global batch", lambda r: r.settings.get("global_batch_size")),
    ("lr", lambda r: r.lr_text),
    ("lr schedule", lambda r: r.settings.get("lr_schedule")),
    ("max grad norm", lambda r: r.clip_text),
    ("precision", lambda r: r.settings.get("precision")),
    ("seed", lambda r: r.settings.get("seed")),
)


def differences(runs: list[Run]) -> list[str]:
    """One line per setting whose known values differ between the runs, naming each run's
    value ("?" where its files do not record it): why overlaid curves may differ."""
    lines = []
    for name, value_of in SETTINGS:
        values = [value_of(r) for r in runs]
        if len({str(v) for v in values if v is not None}) > 1:
            each = ", ".join(_named(r.label, "?" if v is None else str(v))
                             for r, v in zip(runs, values))
            note = ("; |Δ loss| is drawn at the steps both runs have"
                    if name == "steps" else "")
            lines.append(f"runs differ in {name}: {each}{note}")
    return lines


def _named(label: str, value: str) -> str:
    """"label value", or the value alone where it starts with the label ("zero3 on 2 ranks")."""
    return value if value.split(" ")[0] == label else f"{label} {value}"
