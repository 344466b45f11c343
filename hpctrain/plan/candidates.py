"""The plans a run could use: every mesh pp x dp x tp of the ranks with every dp flavour,
kept only when hpctrain's own checks (config.py, parallel/plan.py, the tensor and pipeline
checks) accept it, so a printed plan is one ``hpctrain train`` would run."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.registry import FLAVOUR_NAMES, SHARDED_FLAVOURS, flavour as flavour_of

__all__ = ["Candidate", "Request", "candidates", "config_of", "overrides_of"]

# (flavour, fsdp sharding strategy) of the dp dimension; HYBRID only across several nodes.
DP_CHOICES = tuple((f, "") for f in FLAVOUR_NAMES if f != "fsdp") + (
    ("fsdp", "FULL_SHARD"), ("fsdp", "SHARD_GRAD_OP"), ("fsdp", "HYBRID_SHARD"))
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Request:
    """What the user asked: ranks, memory per rank, precision, optimizer, batch."""

    ranks: int
    ranks_per_node: int
    memory_gb: float
    precision: str = "bf16"
    optimizer: str = "adamw"
    momentum: float = 0.0
    global_batch: int = 32
    grad_accum: int = 1
    microbatches: int = 4
    autocast: bool = False  # price bf16/fp16 states as hpctrain's autocast (fp32) does
    reduce_bucket_size: int = 1 << 24       # [zero]/[fsdp] reduce_bucket_size, bytes
    allgather_bucket_size: int = 1 << 30    # [fsdp] allgather_bucket_size, bytes

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // self.ranks_per_node) if self.ranks_per_node else 1


@dataclass(frozen=True)
class Candidate:
    """One plan: mesh degrees, dp flavour (+ fsdp sharding), pipeline schedule, sequence
    parallel."""

    pp: int
    dp: int
    tp: int
    flavour: str
    sharding: str = ""
    schedule: str = ""
    sequence_parallel: bool = False

    @property
    def dp_label(self) -> str:
        if self.flavour == "fsdp":
            return {"FULL_SHARD": "fsdp", "SHARD_GRAD_OP": "fsdp:SHARD_GRAD_OP",
                    "HYBRID_SHARD": "fsdp:HYBRID"}[self.sharding]
        return self.flavour

    def label(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pp{self.pp}:{self.schedule}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.dp > 1 or not parts:
            parts.append(f"{self.dp_label}x{self.dp}" if parts else self.dp_label)
        return " ".join(parts)

    def mesh(self) -> str:
        dims = [f"{k}={v}" for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
                if v > 1]
        return ",".join(dims)

    def strategy(self) -> str:
        if self.pp > 1:
            return "pipeline"
        if self.tp > 1:
            return "tensor"
        return self.flavour


def config_of(c: Candidate, req: Request, spec: str, options: dict,
              activation_checkpointing: bool = False) -> Config:
    """The Config that runs candidate c (not yet validated)."""
    return load_config(None, [overrides_of(c, req, spec, options, activation_checkpointing)])


def overrides_of(c: Candidate, req: Request, spec: str, options: dict,
                 activation_checkpointing: bool = False) -> dict:
    """{table: {key: value}}: what candidate c changes from the config defaults."""
    t = {"model": spec, "strategy": c.strategy(), "global_batch_size": req.global_batch,
         "precision": req.precision, "optimizer": req.optimizer,
         "grad_accum": req.grad_accum}
    if req.momentum:
        t["momentum"] = req.momentum
    if activation_checkpointing:
        t["activation_checkpointing"] = True
    if options:
        t["model_options"] = dict(options)
    data = {"train": t}
    runtime = {}
    if c.pp > 1 or c.tp > 1:
        runtime["mesh"] = c.mesh()
        if c.flavour != "ddp":
            runtime["dp_flavour"] = c.flavour
    if runtime:
        data["runtime"] = runtime
    if c.flavour == "fsdp" and c.sharding != "FULL_SHARD":
        data["fsdp"] = {"sharding_strategy": c.sharding}
    buckets = {}
    if c.flavour in SHARDED_FLAVOURS and \
            req.reduce_bucket_size != Request.reduce_bucket_size:
        buckets["reduce_bucket_size"] = req.reduce_bucket_size
    if c.flavour == "fsdp" and req.allgather_bucket_size != Request.allgather_bucket_size:
        buckets["allgather_bucket_size"] = req.allgather_bucket_size
    if buckets:
        table = flavour_of(c.flavour).table
        data[table] = {**data.get(table, {}), **buckets}
    if c.pp > 1:
        data["pipeline"] = {"schedule": c.schedule, "microbatches": req.microbatches}
    if c.sequence_parallel:
        data["tensor"] = {"sequence_parallel": True}
    return data


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(shape, req: Request):
    """(pp, dp, tp) with pp*dp*tp = ranks that the model can take at all."""
    for tp in _divisors(req.ranks):
        if tp > 1 and not shape.tp_plan:
            continue
        for pp in _divisors(req.ranks // tp):
            if pp > 1 and (not shape.pipelinable or pp > len(shape.layers)):
                continue
            yield pp, req.ranks // (tp * pp), tp


def _variants(pp: int, dp: int, tp: int, req: Request, shape):
    for flavour, sharding in DP_CHOICES:
        if dp == 1 and (flavour, sharding) != ("ddp", "") and req.ranks > 1:
            continue  # sharding over one replica is ddp with extra steps
        if sharding == "HYBRID_SHARD" and (pp > 1 or tp > 1 or req.nodes < 2 or
                                           req.ranks_per_node < 2):
            continue
        for schedule in (SCHEDULES if pp > 1 else ("",)):
            sps = (False, True) if tp > 1 and shape.gpt is not None and \
                shape.gpt.seq % tp == 0 else (False,)
            for sp in sps:
                yield Candidate(pp, dp, tp, flavour, sharding, schedule, sp)


def _check(c: Candidate, req: Request, shape) -> str:
    """'' when c runs, else why not (hpctrain's own message)."""
    try:
        config_of(c, req, shape.spec, shape.options).validate(req.ranks)
    except ConfigError as exc:
        return str(exc)
    if c.tp > 1:
        from hpctrain.parallel.tensor import check_sharding

        try:
            check_sharding(shape.tp_splits(c.tp), c.tp, c.flavour, c.dp)
        except ValueError as exc:
            return str(exc)
        if c.sequence_parallel and shape.gpt.seq % c.tp:
            return f"sequence parallel needs seq ({shape.gpt.seq}) divisible by tp ({c.tp})"
    return ""


def candidates(shape, req: Request) -> tuple[list, list]:
    """(plans that run, [(plan, why not)] for those hpctrain would refuse)."""
    if req.ranks == 1:
        return [Candidate(1, 1, 1, "single")], []
    ok, refused = [], []
    for pp, dp, tp in _meshes(shape, req):
        for c in _variants(pp, dp, tp, req, shape):
            why = _check(c, req, shape)
            (refused.append((c, why)) if why else ok.append(c))
    return ok, refused
