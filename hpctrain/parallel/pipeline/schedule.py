"""Pipeline schedules as pure lists of steps per rank: unit-testable without MPI.

A rank's schedule is a list of ``Action(op, mb, chunk)``: run the forward ("F") or the
backward ("B") of micro-batch ``mb`` through the rank's model chunk ``chunk``. With ``p``
ranks and ``v`` chunks per rank there are ``S = p*v`` stages; chunk ``c`` of rank ``r`` is
stage ``c*p + r`` (interleaved placement: the model goes round the ranks v times).
Communication follows from the actions: F of stage g>0 receives from stage g-1, B of stage
g<S-1 receives from stage g+1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "SCHEDULES", "gpipe", "one_f_one_b", "interleaved_1f1b", "build",
           "forward_only",
           "stage_of", "peak_live", "simulate", "bubble_formula"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Action:
    op: str      # "F" or "B"
    mb: int      # micro-batch index
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, p: int) -> int:
    """Global stage index of ``chunk`` on ``rank`` (p ranks)."""
    return chunk * p + rank


def gpipe(p: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards: m micro-batches of activations alive at once."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """Warm up with p-rank-1 forwards, then alternate F/B: at most p-rank activations alive."""
    warm = min(p - rank - 1, m)
    acts = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        acts += [Action("F", warm + i), Action("B", i)]
    return acts + [Action("B", i) for i in range(m - warm, m)]


def interleaved_1f1b(p: int, m: int, v: int, rank: int) -> list[Action]:
    """1F1B over v chunks per rank (Narayanan et al. 2021): micro-batches go in groups of p
    through chunk 0, then chunk 1, ...; the bubble shrinks by v. Needs m % p == 0."""
    if m % p:
        raise ValueError(f"interleaved-1f1b needs the micro-batch count ({m}) to be a multiple "
                         f"of the pipeline depth ({p}); set pipeline.microbatches to a multiple of {p}")
    total = m * v

    def chunk_f(k):
        return (k % (p * v)) // p

    def mb(k):
        return (k // (p * v)) * p + k % p

    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    acts = [Action("F", mb(k), chunk_f(k)) for k in range(warm)]
    for i in range(total - warm):
        k = warm + i
        acts += [Action("F", mb(k), chunk_f(k)), Action("B", mb(i), v - 1 - chunk_f(i))]
    return acts + [Action("B", mb(i), v - 1 - chunk_f(i)) for i in range(total - warm, total)]


def forward_only(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Evaluation: the forwards of m micro-batches, each through the rank's v chunks in
    turn, no backwards. Micro-batch-major: taking every micro-batch through chunk 0 first
    would deadlock NCCL's ordered sends at v > 1 (a test replays both)."""
    return [Action("F", i, c) for i in range(m) for c in range(v)]


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """The action list of every rank for a named schedule."""
    if schedule == "gpipe":
        return [gpipe(p, m, r) for r in range(p)]
    if schedule == "1f1b":
        return [one_f_one_b(p, m, r) for r in range(p)]
    if schedule == "interleaved-1f1b":
        return [interleaved_1f1b(p, m, v, r) for r in range(p)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def peak_live(actions: list[Action]) -> int:
    """Most micro-batch activations (per chunk) alive at once on a rank: F done, B not yet."""
    live, peak = set(), 0
    for a in actions:
        if a.op == "F":
            live.add((a.mb, a.chunk))
            peak = max(peak, len(live))
        else:
            live.discard((a.mb, a.chunk))
    return peak


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage: (p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v*m+p-1) interleaved.

    The interleaved form is (p-1)/(v*m) measured against the ideal time, i.e. as a share of
    the total (ideal + bubble) time it is (p-1)/(v*m + p-1); both reduce to GPipe's at v=1.
    """
    return (p - 1) / (v * m + p - 1)


def simulate(schedules: list[list[Action]], v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
             cost=None, latency: float = 0.0):
    """Run the schedules on an ideal machine (no communication cost); return per-rank
    (busy, finish) times and the makespan. Raises ValueError if the schedules deadlock or a
    dependency is missing, so a schedule that passes here cannot hang over MPI.

    Every forward costs ``t_f`` and every backward ``t_b``, unless ``cost(op, mb, stage)``
    is given: then each action costs what it returns (the bench passes measured times, to
    tell unequal stages apart from communication). ``latency``: a result produced on another
    rank arrives that much after its producer finishes (a message's one-way time)."""
    p = len(schedules)
    S = p * v
    done: dict = {}      # (op, mb, stage) -> finish time
    pos = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    total = sum(len(s) for s in schedules)
    finished = 0
    while finished < total:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = schedules[r][pos[r]]
                g = stage_of(r, a.chunk, p)
                if a.op == "F":
                    deps = [("F", a.mb, g - 1)] if g > 0 else []
                else:
                    deps = [("F", a.mb, g)] + ([("B", a.mb, g + 1)] if g < S - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] + (latency if d[2] % p != r else 0.0)
                                         for d in deps])
                dt = cost(a.op, a.mb, g) if cost else (t_f if a.op == "F" else t_b)
                done[(a.op, a.mb, g)] = free[r] = start + dt
                busy[r] += dt
                pos[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = {r: schedules[r][pos[r]] for r in range(p) if pos[r] < len(schedules[r])}
            raise ValueError(f"pipeline schedule deadlocks: ranks wait at {stuck}")
    makespan = max(free)
    return {"busy": busy, "finish": free, "makespan": makespan,
            "bubble": [1 - b / makespan for b in busy]}
