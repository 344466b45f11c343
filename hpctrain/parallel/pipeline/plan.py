"""Which layers each stage gets: balanced by cost, or at explicit split points (pure)."""

from __future__ import annotations

__all__ = ["check_fits", "balanced_split", "split_at", "stage_layers"]


def check_fits(n_layers: int, p: int, v: int, schedule: str) -> None:
    """Raise ValueError if p*v stages cannot each get at least one of n_layers layers."""
    stages = p * v
    if stages <= n_layers:
        return
    if schedule == "interleaved-1f1b":
        raise ValueError(
            f"interleaved-1f1b with pp={p} and pipeline.virtual_stages={v} needs {stages} stages "
            f"(pp x virtual_stages) but the model has only {n_layers} layers; lower "
            f"pipeline.virtual_stages to at most {max(1, n_layers // p)} or use a deeper model")
    raise ValueError(
        f"pipeline with pp={p} stages but the model has only {n_layers} layers (each stage needs "
        f"at least one); use pp <= {n_layers} in --mesh or a deeper model")


def balanced_split(costs, stages: int) -> list[int]:
    """Start index of each of ``stages`` contiguous non-empty groups minimising the largest
    group cost (dynamic programming; ties go to the earliest split).

    ``costs`` is one cost per layer, or one such list per pipeline rank (layer costs as
    measured on that rank): group s then runs on rank s % len(costs) and costs what the
    layers cost there, so a slower rank gets fewer layers."""
    per_rank = [list(map(float, c)) for c in costs] if costs and isinstance(
        costs[0], (list, tuple)) else [list(map(float, costs))]
    n = len(per_rank[0])
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    prefix = []
    for row in per_rank:
        acc = [0.0]
        for c in row:
            acc.append(acc[-1] + c)
        prefix.append(acc)
    inf = float("inf")
    # best[s][i]: minimal max cost of putting layers [0, i) into s groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        pre = prefix[(s - 1) % len(prefix)]  # group s-1 (0-based) runs on this rank
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                val = max(best[s - 1][j], pre[i] - pre[j])
                if val < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = val, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def split_at(points, names: list[str], stages: int, modules: dict | None = None) -> list[int]:
    """Stage start indices from 'i,j,...' or a list: layer indices, layer names or module
    paths (``modules``: {path: index of the layer holding it}) where stages 2.. begin."""
    items = points.split(",") if isinstance(points, str) else [str(x) for x in points]
    items = [x.strip() for x in items if x.strip()]
    modules = modules or {}
    starts = [0]
    for item in items:
        if item.lstrip("-").isdigit():
            idx = int(item)
        elif item in names:
            idx = names.index(item)
        elif item in modules:
            idx = modules[item]
        else:
            raise ValueError(f"pipeline.split_points: {item!r} is neither a layer index nor a "
                             f"layer name (nor the path of a module a layer holds); layers "
                             f"are {', '.join(names)}")
        starts.append(idx)
    if len(starts) != stages:
        raise ValueError(f"pipeline.split_points = {points!r} gives {len(starts)} stages but the "
                         f"mesh and schedule need {stages}; give {stages - 1} split points")
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= len(names):
        raise ValueError(f"pipeline.split_points = {points!r} must be strictly increasing layer "
                         f"indices in 1..{len(names) - 1} (every stage non-empty)")
    return starts


def stage_layers(starts: list[int], n_layers: int) -> list[list[int]]:
    """Layer indices of each stage from its start index."""
    ends = starts[1:] + [n_layers]
    return [list(range(a, b)) for a, b in zip(starts, ends)]
