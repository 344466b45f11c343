"""The one registry of parallelisms: each mesh dimension and each data-parallel flavour,
declared once.

Pure (imports nothing from hpctrain, no torch, no MPI), so every layer may read it, the
runtime's mesh included, and the config checks it before MPI starts. Everything that names
a strategy or a mesh key derives from these tables: the mesh's keys and rank order
(runtime/mesh.py), the config's strategy tables and choices (config.py), the plan's degrees,
composition rules and names (parallel/plan.py), the orchestrator's transform order and
flavour modules, the CLI's choices, ``wrap()``'s shorthand names, the sharded flavours'
optimizer rule (train/optimizers.py) and the bench workloads. Adding a parallelism is one
entry here, the transform's own package, and its tests (README: "Adding a parallelism").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["Flavour", "Dimension", "OPTIONS", "FLAVOURS", "FLAVOUR_NAMES", "DIMENSIONS", "STRATEGIES",
           "STRATEGY_TABLE", "TABLES", "SHARDED_FLAVOURS", "DP_KEY", "MESH_KEYS", "GRID_KEYS",
           "options_class", "flavour", "dimension",
           "by_transform_order", "ddp_by_engine", "tables_read", "strategies_reading",
           "default_mesh", "composition_error"]


@dataclass(frozen=True)
class Flavour:
    """A data-parallel flavour over the mesh's dp replicas (its own shorthand strategy)."""

    name: str
    table: str  # the config table its options come from
    module: str  # its transform: ``module.wrap(model, make_optimizer, world, options, ...)``
    sharded: bool  # steps the optimizer on flat 1-D shards (elementwise optimizers only)
    # what each rank keeps of the model state (bench/workload.py's per-rank formula):
    # "replicated", "zero1" (optimizer state sharded), "zero2" (+ gradients), "sharded" (all)
    memory: str
    stage: int | None = None  # the ZeRO stage it presets


@dataclass(frozen=True)
class Dimension:
    """A model-parallel mesh dimension and the transform that splits the model over it."""

    key: str  # the mesh key (``--mesh tp=2``)
    strategy: str  # the transform's name: its shorthand strategy and plan-name part
    table: str  # its config table (OPTIONS names the options class that is the table)
    order: int  # transforms apply in ascending order (tensor, domain, then pipeline)
    composes_with: tuple  # the other dimensions it shares a mesh with (dp: always)
    noun: str  # how messages call it
    # The ddp flavour under it is the sharding engine's all-reduce (NO_SHARD): Horovod
    # reduces over the whole job, not over one stage's or one tp slice's replicas.
    ddp_by_engine: bool
    # Its place in the ranks' row-major order (MESH_KEYS): the higher, the faster its
    # coordinate varies, so the closer its partners sit (same node first).
    place: int
    grid: bool = False  # its degree is a grid shape (``dom=2x2``), not one integer
    # "module:function": ``function(model, world, mesh, options) -> (model, executor)``,
    # applied by the orchestrator in ``order`` (tensor, domain and pipeline, whose
    # interplay needs it, have their own steps there).
    transform: str = ""


FLAVOURS = (
    Flavour("ddp", "ddp", "hpctrain.parallel.ddp", sharded=False, memory="replicated"),
    Flavour("zero1", "zero", "hpctrain.parallel.zero", sharded=True, memory="zero1", stage=1),
    Flavour("zero2", "zero", "hpctrain.parallel.zero", sharded=True, memory="zero2", stage=2),
    Flavour("zero3", "zero", "hpctrain.parallel.zero", sharded=True, memory="sharded", stage=3),
    Flavour("fsdp", "fsdp", "hpctrain.parallel.fsdp", sharded=True, memory="sharded"),
)

# Declared in the order plan names join them (``pipeline+tensor``); ``order`` is the
# orchestrator's, ``place`` the ranks'.
DIMENSIONS = (
    Dimension("pp", "pipeline", "pipeline", order=3, composes_with=("tp",),
              noun="pipeline stages", ddp_by_engine=True, place=0),
    Dimension("dom", "domain", "domain", order=2, composes_with=(),
              noun="a domain split", ddp_by_engine=False, place=20, grid=True),
    Dimension("tp", "tensor", "tensor", order=1, composes_with=("pp",),
              noun="tensor parallel", ddp_by_engine=True, place=30),
)

#: The dp replicas' mesh key (every plan has it; its flavour keeps them in step) and its
#: place: after pp, so pipeline stages span nodes, where point-to-point traffic is lightest.
DP_KEY, DP_PLACE = "dp", 10
#: The mesh keys in rank order (row-major, the last varying fastest: pp, dp, dom, tp).
MESH_KEYS = tuple(k for _, k in sorted([(DP_PLACE, DP_KEY)] + [(d.place, d.key)
                                                                for d in DIMENSIONS]))
#: The keys whose degree is a grid shape.
GRID_KEYS = tuple(d.key for d in DIMENSIONS if d.grid)

#: Each options table's typed options class ("module:Class", in a module that imports no
#: torch): the class IS the config table (config.py builds [table] from it, its fields'
#: metadata the help, choices and bounds), in the order the tables are listed.
OPTIONS = {
    "ddp": "hpctrain.parallel.ddp_options:DDPOptions",
    "zero": "hpctrain.parallel.zero_options:ZeroOptions",
    "pipeline": "hpctrain.parallel.pipeline.options:PipelineOptions",
    "domain": "hpctrain.parallel.domain.options:DomainOptions",
    "tensor": "hpctrain.parallel.tensor.options:TensorOptions",
    "fsdp": "hpctrain.parallel.fsdp_options:FSDPOptions",
}

FLAVOUR_NAMES = tuple(f.name for f in FLAVOURS)
SHARDED_FLAVOURS = tuple(f.name for f in FLAVOURS if f.sharded)
STRATEGIES = ("single",) + FLAVOUR_NAMES + tuple(d.strategy for d in DIMENSIONS)
#: The options table of each shorthand strategy (single has none).
STRATEGY_TABLE = {**{f.name: f.table for f in FLAVOURS},
                  **{d.strategy: d.table for d in DIMENSIONS}}
#: Every strategy options table, each once.
TABLES = tuple(dict.fromkeys(STRATEGY_TABLE.values()))

_FLAVOUR = {f.name: f for f in FLAVOURS}
_DIMENSION = {d.strategy: d for d in DIMENSIONS}


def options_class(table: str) -> type:
    """The options class of ``table`` (imported: its module is pure)."""
    module, _, name = OPTIONS[table].partition(":")
    return getattr(importlib.import_module(module), name)


def flavour(name: str) -> Flavour:
    return _FLAVOUR[name]


def dimension(strategy_or_key: str) -> Dimension:
    """The dimension named by its strategy (``tensor``) or its mesh key (``tp``)."""
    for d in DIMENSIONS:
        if strategy_or_key in (d.strategy, d.key):
            return d
    raise KeyError(strategy_or_key)


def by_transform_order() -> tuple:
    return tuple(sorted(DIMENSIONS, key=lambda d: d.order))


def ddp_by_engine(plan) -> bool:
    """Whether the plan's ddp flavour is the sharding engine's NO_SHARD all-reduce (under a
    dimension Horovod cannot reduce for)."""
    return plan.flavour == "ddp" and any(plan.uses(d.strategy) and d.ddp_by_engine
                                         for d in DIMENSIONS)


def tables_read(plan) -> tuple:
    """The options tables the plan reads: its dimensions' tables, then its flavour's (none
    for the engine's ddp)."""
    if plan.name == "single":
        return ()
    dims = tuple(d.table for d in DIMENSIONS if plan.uses(d.strategy))
    return dims + (() if ddp_by_engine(plan) else (flavour(plan.flavour).table,))


def strategies_reading(table: str) -> tuple:
    """The shorthand strategies whose one-dimensional plan reads ``table``."""
    out = [f.name for f in FLAVOURS if f.table == table]
    for d in DIMENSIONS:
        if d.table == table or (table == "ddp" and not d.ddp_by_engine):
            out.append(d.strategy)
    return tuple(out)


def default_mesh(strategy: str, world_size: int) -> str:
    """The mesh of a shorthand strategy given without ``--mesh``: every rank on its
    dimension ('' for the flavours: every rank a dp replica)."""
    d = _DIMENSION.get(strategy)
    return f"{d.key}={world_size},dp=1" if d else ""


def composition_error(strategy: str, layout, shown: str) -> str:
    """Why the resolved mesh ``layout`` (runtime.mesh.MeshLayout) cannot run under
    ``strategy``, or '' when it can. ``shown``: the mesh as the user gave it."""
    degrees = layout.degrees()
    used = [d for d in DIMENSIONS if degrees[d.key] > 1]
    own = _DIMENSION.get(strategy)
    if own is not None:
        allowed = (own.key, "dp") + own.composes_with
        extra = [d.key for d in used if d.key not in allowed]
        if extra:
            keys = list(allowed)
            listed = ", ".join(keys[:-1]) + " and " + keys[-1]
            return (f"runtime.mesh = {shown!r}: strategy '{strategy}' uses {listed}"
                    f"{' only' if not own.composes_with else ''}; drop {', '.join(extra)}")
    for d in sorted(used, key=lambda d: len(d.composes_with)):  # the most restricted speaks
        clash = [o for o in used if o is not d and o.key not in d.composes_with]
        if clash:
            others = [o.noun for o in DIMENSIONS if o is not d and o.key not in d.composes_with]
            partners = ", ".join(["dp"] + list(d.composes_with))
            degree = getattr(layout, d.key)
            text = "x".join(map(str, degree)) if isinstance(degree, tuple) else degree
            return (f"runtime.mesh = {shown!r}: {d.noun} ({d.key}={text}) "
                    f"composes with {partners} only, not with {' or '.join(others)}; use "
                    f"{d.key} with {partners}, or the others without it")
    return ""
