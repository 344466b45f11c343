"""Report: one PNG of a run (loss with validation, lr, gradient norm, throughput, peak memory
per rank), or several runs overlaid.

``hpctrain report DIR [DIR ...]`` redraws a finished run later, or lays the runs of several
strategies over each other with the difference of each loss curve from the first: the picture
that shows at a glance whether they train alike; the settings in which overlaid runs differ
(report_runs.py) go under the title. The runs come from report_runs.load_runs. matplotlib is
imported only when drawing, so ``import hpctrain`` stays fast and training works without it.
"""

from __future__ import annotations

import math
import os
import statistics

from hpctrain.train.metrics import SUMMARY_NAME
from hpctrain.train.report_runs import (Run, differences, load_run, steps_shared_with_first,
                                        title_of)

__all__ = ["REPORT_NAME", "draw_report", "report_after_training"]

REPORT_NAME = "report.png"
EQUIVALENCE_RTOL = 1e-5   # DESIGN.md: a strategy reproduces single-process losses to this
ZERO_DIFF_FLOOR = 1e-16   # where every |diff| is exactly 0: a log axis cannot show 0
MAX_BAR_LABELS = 16       # value labels on the memory bars up to this many bars
NO_GRAD_NORM = ("no gradient norm recorded\n(train.nonfinite = ignore and no "
                "--max-grad-norm: nothing computed it)")


def draw_report(runs: list[Run], path: str) -> str:
    """Draw one run (loss with validation, lr, gradient norm, throughput, memory, settings)
    or an overlay (plus |loss - first run's|, and the settings that differ under the title)
    to the PNG ``path``; return the path. Raises ReportError or ImportError (no matplotlib)."""
    shared = steps_shared_with_first(runs)  # checked before anything is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # The object API with its own Agg canvas: no pyplot, so no global backend switch in the
    # user's process and nothing kept alive after saving.
    title = title_of(runs)
    if len(runs) == 1:
        fig = Figure(figsize=(16, 8.6), layout="constrained")
        (ax_loss, ax_lr, ax_norm), (ax_speed, ax_mem, ax_facts) = fig.subplots(2, 3)
        _write_settings(ax_facts, runs[0])
    else:
        fig = Figure(figsize=(14, 12.5), layout="constrained")
        (ax_loss, ax_diff), (ax_lr, ax_norm), (ax_speed, ax_mem) = fig.subplots(3, 2)
        _plot_loss_difference(ax_diff, runs, shared)
        title = "\n".join([title] + differences(runs))
    _plot_loss(ax_loss, runs)
    _plot_lr(ax_lr, runs)
    _plot_grad_norm(ax_norm, runs)
    _plot_throughput(ax_speed, runs)
    _plot_peak_memory(ax_mem, runs)
    for ax in (ax_loss, ax_lr, ax_norm, ax_speed) + (() if len(runs) == 1 else (ax_diff,)):
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    fig.suptitle(title, fontsize=12)
    FigureCanvasAgg(fig)
    _save_png(fig, path)
    return path


def _plot_loss(ax, runs: list[Run]) -> None:
    """Training loss per step; the validations as open squares joined by a dotted line."""
    for i, r in enumerate(runs):
        # Later runs dashed and thinner, so equal curves still show every run.
        ax.plot(r.steps, r.losses, color=f"C{i}", lw=2.2 - 0.5 * min(i, 2),
                ls="-" if i == 0 else "--", marker="o" if len(r.steps) <= 30 else None, ms=3,
                label=f"{r.label} · final {r.final_loss:.6g}")
        if r.val_steps:
            ax.plot(r.val_steps, r.val_losses, color=f"C{i}", ls=":", lw=1.5, marker="s",
                    ms=6, mfc="white", mew=1.5,
                    label=f"{r.label} validation · last {r.val_losses[-1]:.6g} "
                          f"(step {r.val_steps[-1]})")
    validated = any(r.val_steps for r in runs)
    ax.set(title="loss per step" + ("  (□: validation)" if validated else ""), xlabel="step",
           ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_lr(ax, runs: list[Run]) -> None:
    drawn = False
    for i, r in enumerate(runs):
        if any(v is not None for v in r.lrs):
            ax.plot(r.steps, [math.nan if v is None else v for v in r.lrs], color=f"C{i}",
                    lw=2.0 - 0.5 * min(i, 2), ls="-" if i == 0 else "--",
                    label=f"{r.label} · lr {r.lr_text}")
            drawn = True
    ax.set(title="learning rate (at each step)", xlabel="step", ylabel="lr")
    if not drawn:
        _empty(ax, "no lr in metrics.csv")
        return
    ax.set_ylim(bottom=0)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_grad_norm(ax, runs: list[Run]) -> None:
    """The global gradient norm before clipping (log axis); steps whose norm is NaN, inf or
    0 (a log axis has no place for them) are counted in the legend, not drawn; the clipping
    threshold dashed."""
    ax.set(title="gradient norm (global, before clipping)", xlabel="step", ylabel="L2 norm")
    drawn = False
    for i, r in enumerate(runs):
        recorded = [v for v in r.grad_norms if v is not None]
        if not recorded:
            continue
        drawable = [v if v is not None and math.isfinite(v) and v > 0 else math.nan
                    for v in r.grad_norms]
        bad = sum(1 for v in recorded if not (math.isfinite(v) and v > 0))
        ax.plot(r.steps, drawable, color=f"C{i}", lw=1.6 - 0.4 * min(i, 2),
                ls="-" if i == 0 else "--",
                label=f"{r.label} · last {recorded[-1]:.3g}" +
                      (f" ({bad} step{'s' if bad != 1 else ''} NaN, inf or 0: not drawn)"
                       if bad else ""))
        clip = r.settings.get("max_grad_norm")
        if clip:
            ax.axhline(clip, color=f"C{i}", ls=(0, (6, 3)), lw=1,
                       label=f"{r.label} clips at {clip:g}")
        drawn = True
    if not drawn:
        _empty(ax, NO_GRAD_NORM)
        return
    ax.set_yscale("log")
    _plain_log_labels(ax)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _plain_log_labels(ax) -> None:
    """Plain numbers (0.2, 5) on a log y axis, not 2×10⁻¹; minor ticks labelled at 2 and 5
    while the axis spans at most two decades (more would crowd it)."""
    from matplotlib.ticker import FuncFormatter

    def minor(x, _pos):
        lo, hi = ax.get_ylim()
        mantissa = x / 10.0 ** math.floor(math.log10(x) + 1e-9)
        wanted = hi / lo <= 100 and round(mantissa, 6) in (2.0, 5.0)
        return f"{x:g}" if wanted else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _write_settings(ax, r: Run) -> None:
    """The run's settings and results as a small table of text (one run's report)."""
    s = r.settings
    finite = [v for v in r.units_per_s if math.isfinite(v)]
    batch = s.get("global_batch_size")
    accum = s.get("grad_accum")
    rows = [
        ("strategy", r.strategy_text), ("model", None if r.model == "?" else r.model),
        ("steps", r.steps_text),
        ("global batch", None if batch is None else
         f"{batch}" + (f" ({accum} accumulation steps)" if accum and accum > 1 else "")),
        ("lr", r.lr_text and " ".join(filter(None, (r.lr_text, s.get("lr_schedule"))))),
        ("max grad norm", r.clip_text), ("precision", s.get("precision")),
        ("seed", s.get("seed")),
        ("final loss", f"{r.final_loss:.6g}"),
        ("validation", f"{r.val_losses[-1]:.6g} at step {r.val_steps[-1]}" if r.val_steps
         else None),
        ("throughput", f"{statistics.median(finite):,.0f} {r.unit}/s (median)" if finite
         else None),
        ("peak RSS", f"{max(r.peak_rss_mb_per_rank):,.0f} MiB (max over ranks)"
         if r.peak_rss_mb_per_rank else None),
    ]
    text = "\n".join(f"{k:<14}{v}" for k, v in rows if v is not None)
    ax.axis("off")
    ax.set_title("run", loc="left")
    ax.text(0.02, 0.98, text, va="top", ha="left", family="monospace", fontsize=10,
            transform=ax.transAxes)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _plot_loss_difference(ax, runs: list[Run], shared: list[list[int]]) -> None:
    """|loss - first run's loss| on a log axis, with the equivalence tolerance for scale.

    Exact zeros cannot sit on a log axis: they are triangles on a floor below every other
    value, and the line breaks there.
    """
    ref = dict(zip(runs[0].steps, runs[0].losses))
    ax.plot(runs[0].steps, [EQUIVALENCE_RTOL * abs(v) for v in runs[0].losses], color="0.5",
            ls=":", label=f"rtol {EQUIVALENCE_RTOL:g} × |loss|")
    diffs = [[abs(by_step[s] - ref[s]) for s in steps]
             for by_step, steps in zip((dict(zip(r.steps, r.losses)) for r in runs[1:]), shared)]
    floor = _log_floor([d for ds in diffs for d in ds] + [EQUIVALENCE_RTOL * abs(v) for v in ref.values()])
    for i, (r, steps, ds) in enumerate(zip(runs[1:], shared, diffs), start=1):
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, [d if d > 0 else math.nan for d in ds], color=f"C{i}", marker=marker,
                ms=3, label=f"{r.label} (max {max(ds):.2g}; equal at {ds.count(0.0)}/{len(ds)} steps)")
        zeros = [s for s, d in zip(steps, ds) if d == 0]
        ax.plot(zeros, [floor] * len(zeros), ls="none", marker="v", color=f"C{i}", ms=6)
    ax.set_yscale("log")
    ax.set(title=f"|loss - {runs[0].label} loss|  (▼: equal, drawn at {floor:.0e})",
           xlabel="step", ylabel="absolute difference")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _log_floor(values: list[float]) -> float:
    """A power of ten below the smallest positive finite value (1e-16 if there is none)."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return ZERO_DIFF_FLOOR
    return 10.0 ** (math.floor(math.log10(min(positive))) - 1)


def _plot_throughput(ax, runs: list[Run]) -> None:
    for i, r in enumerate(runs):
        finite = [v for v in r.units_per_s if math.isfinite(v)]
        # The median, not the mean: the first steps (warm-up) do not pull it down.
        median = statistics.median(finite) if finite else math.nan
        ax.plot(r.steps, r.units_per_s, color=f"C{i}", lw=1.2,
                label=f"{r.label} (median {median:,.0f})")
        ax.axhline(median, color=f"C{i}", ls=":", lw=1)
    units = " / ".join(dict.fromkeys(r.unit for r in runs))
    ax.set(title=f"throughput ({units}/s; dotted: median)", xlabel="step", ylabel=f"{units}/s")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_peak_memory(ax, runs: list[Run]) -> None:
    """A bar per rank (grouped by rank when overlaid)."""
    drawn = [r for r in runs if r.peak_rss_mb_per_rank]
    ax.set(title="peak memory per rank (RSS)", xlabel="rank", ylabel="MiB")
    if not drawn:
        _empty(ax, f"no peak_rss_mb_per_rank in {SUMMARY_NAME}")
        return
    width = 0.8 / len(drawn)
    most = max(len(r.peak_rss_mb_per_rank) for r in drawn)
    for i, r in enumerate(drawn):
        ranks = range(len(r.peak_rss_mb_per_rank))
        bars = ax.bar([k + (i - (len(drawn) - 1) / 2) * width for k in ranks],
                      r.peak_rss_mb_per_rank, width, color=f"C{runs.index(r)}", label=r.label)
        if most * len(drawn) <= MAX_BAR_LABELS:
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(most))
    pad = max(0.6, (4 - most) / 2)  # a few ranks: narrow bars, not the whole axes
    ax.set_xlim(-pad, most - 1 + pad)
    ax.grid(alpha=0.3, axis="y")
    if len(drawn) > 1:
        ax.legend(fontsize=8)


def _save_png(fig, path: str) -> None:
    """Write through a temporary name, so a reader never sees half a picture."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def report_after_training(out_dir: str) -> str | None:
    """Draw ``out_dir/report.png`` for the run just trained and print its path (rank 0).

    Never raises: a missing matplotlib or a failed drawing is one warning line, because the
    picture must not fail a run whose training succeeded.
    """
    path = os.path.join(out_dir, REPORT_NAME)
    try:
        draw_report([load_run(out_dir)], path)
    except ImportError as exc:
        print(f"hpctrain: warning: no report ({exc}; pip install matplotlib)", flush=True)
        return None
    except Exception as exc:  # noqa: BLE001 - any drawing failure is a warning here
        print(f"hpctrain: warning: no report ({type(exc).__name__}: {exc})", flush=True)
        return None
    print(f"hpctrain: report {path}", flush=True)
    return path
