"""Estimates as text for people (a table, a legend, the recommended command and TOML), as
JSON for tools, and as a bar chart."""

from __future__ import annotations

import json

from hpctrain.config import _toml_value
from hpctrain.plan.candidates import overrides_of
from hpctrain.plan.estimate import MEGATRON_FORMULA
from hpctrain.units import human_bytes

__all__ = ["command", "describe", "human", "recommend", "table", "to_json", "toml",
           "legend", "chart"]

# Simpler flavours first when everything else ties (fewer collectives to go wrong).
_SIMPLICITY = ("single", "ddp", "zero1", "zero2", "fsdp:SHARD_GRAD_OP", "zero3", "fsdp",
               "fsdp:HYBRID")
_FLAGS = {("train", "model"): "--model", ("train", "strategy"): "--strategy",
          ("train", "global_batch_size"): "--global-batch-size",
          ("train", "precision"): "--precision", ("train", "optimizer"): "--optimizer",
          ("train", "grad_accum"): "--grad-accum", ("runtime", "mesh"): "--mesh",
          ("runtime", "dp_flavour"): "--dp-flavour",
          ("runtime", "ranks_per_node"): "--ranks-per-node",
          ("fsdp", "sharding_strategy"): "--sharding-strategy"}


def human(n: float) -> str:
    """Bytes in decimal units (GB = 1e9, as --memory-gb), two digits."""
    return human_bytes(n, 2)


def describe(e, checkpointing: bool) -> str:
    """'zero3 over 64 ranks' / 'pp4:1f1b zero1x16 over 64 ranks', + checkpointing."""
    c = e.candidate
    ranks = c.pp * c.dp * c.tp
    text = f"{c.label()} over {ranks} rank{'s' if ranks != 1 else ''}"
    return text + (" with activation checkpointing" if checkpointing else "")


def recommend(estimates: list):
    """The plan to use: fits without checkpointing if any does, then the fewest
    model-parallel dimensions, the least communication, the simplest flavour, the least
    memory. None when nothing fits."""
    fitting = [e for e in estimates if e.fits or e.fits_with_ac]
    if not fitting:
        return None
    c_rank = {n: i for i, n in enumerate(_SIMPLICITY)}
    return min(fitting, key=lambda e: (
        not e.fits, (e.candidate.pp > 1) + (e.candidate.tp > 1), round(e.comm, -3),
        c_rank.get(e.candidate.dp_label if e.candidate.dp > 1 else "ddp", 9),
        min(e.total, e.total_ac) if e.fits else e.total_ac))


def _verdict(e) -> str:
    if e.fits:
        return "fits"
    if e.fits_with_ac:
        return "fits with AC"
    return f"DOES NOT FIT (needs {human(e.needed)})"


def table(estimates: list) -> str:
    """One row per plan; a plan that does not fit even with checkpointing is struck
    through (~~plan~~)."""
    head = ("plan", "params", "grads", "optimizer", "gathered", "buffers", "activ", "activ AC",
            "total", "total AC", "comm/step", "verdict")
    rows = []
    for e in estimates:
        label = e.candidate.label()
        if not (e.fits or e.fits_with_ac):
            label = f"~~{label}~~"
        rows.append((label, human(e.params), human(e.grads), human(e.optimizer),
                     human(e.gathered), human(e.buffers), human(e.activations),
                     human(e.activations_ac),
                     human(e.total), human(e.total_ac), human(e.comm), _verdict(e)))
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i in (0, len(head) - 1) else '>'}{w}}}"
                    for i, w in enumerate(widths))
    lines = [fmt.format(*head)] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def legend(shape, req) -> str:
    """The formulas behind the columns, with the numbers of this request."""
    from hpctrain.plan.estimate import state_bytes

    p, g, o = state_bytes(req.precision, req.optimizer, req.momentum, req.autocast)
    lines = [
        f"per rank, bytes in GB = 1e9; Ψ = parameters a rank's stage holds (after the tp "
        f"split), N = ranks sharding them; p={p}, g={g}, o={o} bytes per parameter "
        f"({req.precision}, {req.optimizer}; " + (
            "--states autocast: hpctrain's bf16/fp16 autocast keeps fp32 params, grads and "
            "state)" if req.autocast and req.precision != "fp32" else
            f"ZeRO paper: mixed precision keeps an fp32 master copy in o, K = {o}; "
            "hpctrain's own autocast keeps fp32 params: --states autocast)"),
        "  ddp: pΨ + gΨ + oΨ   zero1: pΨ + gΨ + oΨ/N   zero2: pΨ + (g+o)Ψ/N   "
        "zero3: (p+g+o)Ψ/N + one gathered unit   fsdp: + two (the next one prefetched)   "
        "fsdp:SHARD_GRAD_OP: (p+g+o)Ψ/N + pΨ "
        "gathered (units stay gathered from forward to backward)   fsdp:HYBRID: as fsdp, "
        "N = ranks per node",
        f"  buffers: zero2/zero3/fsdp reduce gradients during backward through buffers of "
        f"at most B = reduce_bucket_size = {req.reduce_bucket_size:,} bytes, and the MPI "
        f"backend stages (N-1)/N of those in flight: B + B·(N-1)/N, + the full gradients of "
        f"the unit whose backward runs (g·unit; gΨ with --grad-accum > 1); zero1: 3g·unit/N "
        f"(its step's reduce-scatter); fsdp prefetches a unit only when it fits "
        f"allgather_bucket_size = {req.allgather_bucket_size:,}",
        f"  activ: Megatron {MEGATRON_FORMULA} per layer (fp16, dropout, unfused "
        f"attention); hpctrain's gpt (fused attention, no dropout) keeps s·b·(16h + a + 4)"
        f"·e, with tp t: s·b·(h·(4 + 12/t) + 4 + a/t)·e, + sequence parallel: "
        f"s·b·(h·(2 + 14/t) + (4 + a)/t)·e (e = 2 bf16/fp16, 4 fp32); other models: what "
        f"autograd saves in a forward of one sample on the meta device, x b",
        "  activ AC: activation checkpointing: each block keeps its input (pipeline: each "
        "layer), plus one block recomputed at a time",
        "  pipeline: x micro-batches alive on the busiest stage (1f1b: up to pp, gpipe: "
        "all m); comm/step: dp 2Ψ (ddp, zero1/2) or 3Ψ (zero3, fsdp) per step, tp "
        "4·L·s·b·h per micro-batch, pp 2·s·b·h per micro-batch (payload bytes)",
    ]
    if shape.gpt is not None:
        d = shape.gpt
        lines.append(f"  model: gpt L={d.layers} h={d.hidden} a={d.heads} V={d.vocab} "
                     f"s={d.seq}, {shape.params():,} parameters")
    else:
        lines.append(f"  model: {shape.spec}, {shape.params():,} parameters")
    return "\n".join(lines)


def command(e, req, shape) -> str:
    """The one-line launch of the plan (``hpctrain train`` flags; --set for the rest)."""
    data = overrides_of(e.candidate, req, shape.spec, shape.options, not e.fits)
    args = []
    for section, values in data.items():
        for key, value in values.items():
            if key == "model_options":
                args += [f"--set train.model_options.{k}={_toml_value(v)}"
                         for k, v in value.items()]
            elif key == "activation_checkpointing":
                args.append("--activation-checkpointing")
            elif (section, key) in _FLAGS:
                args.append(f"{_FLAGS[section, key]} {value}")
            else:
                args.append(f"--set {section}.{key}={_toml_value(value)}")
    launch = f"mpirun -n {req.ranks}"
    return f"{launch} python -m hpctrain train " + " ".join(args)


def toml(e, req, shape) -> str:
    """The same run as a TOML file for ``--config``."""
    data = overrides_of(e.candidate, req, shape.spec, shape.options, not e.fits)
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in tables]
        for k, table_ in tables.items():
            lines.append(f"[{section}.{k}]")
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in table_.items()]
    return "\n".join(lines) + "\n"


def to_json(estimates: list, req, shape, best) -> str:
    def row(e):
        c = e.candidate
        return {"plan": c.label(), "pp": c.pp, "dp": c.dp, "tp": c.tp,
                "dp_flavour": c.flavour, "fsdp_sharding": c.sharding,
                "schedule": c.schedule, "sequence_parallel": c.sequence_parallel,
                "params": e.params, "grads": e.grads, "optimizer": e.optimizer,
                "gathered": e.gathered, "buffers": e.buffers,
                "activations": e.activations,
                "activations_checkpointed": e.activations_ac, "total": e.total,
                "total_checkpointed": e.total_ac, "comm_per_step": e.comm,
                "params_per_rank": e.psi_rank,
                "fits": e.fits, "fits_with_checkpointing": e.fits_with_ac,
                "formulas": e.formulas}
    out = {"ranks": req.ranks, "ranks_per_node": req.ranks_per_node,
           "memory_bytes": req.memory_gb * 1e9, "precision": req.precision,
           "optimizer": req.optimizer, "global_batch": req.global_batch,
           "parameters": shape.params(), "plans": [row(e) for e in estimates],
           "recommended": None}
    if best is not None:
        out["recommended"] = {"plan": best.candidate.label(),
                              "activation_checkpointing": not best.fits,
                              "command": command(best, req, shape),
                              "toml": toml(best, req, shape)}
    return json.dumps(out, indent=2)


def chart(estimates: list, req, path: str) -> None:
    """Stacked bars of per-rank memory per plan (activations as planned: with
    checkpointing where only that fits), the limit as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [e.candidate.label() + ("" if e.fits else " (AC)") for e in estimates]
    parts = [("params", [e.params for e in estimates]),
             ("grads", [e.grads for e in estimates]),
             ("optimizer", [e.optimizer for e in estimates]),
             ("gathered", [e.gathered for e in estimates]),
             ("buffers", [e.buffers for e in estimates]),
             ("activations", [e.activations if e.fits else e.activations_ac
                              for e in estimates])]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(estimates) + 2), 5))
    bottom = [0.0] * len(estimates)
    for name, values in parts:
        gb = [v / 1e9 for v in values]
        ax.bar(range(len(estimates)), gb, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, gb)]
    ax.axhline(req.memory_gb, color="red", linestyle="--",
               label=f"limit {req.memory_gb:g} GB")
    ax.set_xticks(range(len(estimates)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GB per rank")
    ax.set_title(f"hpctrain plan: {req.ranks} ranks, {req.precision}, {req.optimizer}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
