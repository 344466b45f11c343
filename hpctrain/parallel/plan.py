"""The parallel plan: mesh degrees + the data-parallel flavour, built and validated once.

Pure (no torch, no MPI): every rank builds the same plan from the same config and world
size, so a plan that cannot run fails on every rank alike, before any collective. The
orchestrator (``orchestrator.py``) is the only reader that turns it into transforms.

``--strategy NAME`` is a shorthand for a one-dimensional plan (``zero3`` = every rank a dp
replica with flavour zero3, ``pipeline`` = every rank a stage, ``domain`` = every rank a
tile, ``tensor`` = every rank a tensor-parallel slice); ``--mesh`` and ``--dp-flavour``
spell a composed one (``--mesh dom=2,dp=2 --dp-flavour fsdp``). A flavour strategy given with a mesh composes too: ``--strategy zero3
--mesh dom=2,dp=2`` is the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain import registry
from hpctrain.runtime.mesh import MeshLayout

__all__ = ["ParallelPlan", "PlanError", "build_plan"]

_STRATEGIES = tuple(d.strategy for d in registry.DIMENSIONS)


class PlanError(ValueError):
    """The plan cannot run; the message says which degree or flavour and what to do."""


@dataclass(frozen=True, init=False)
class ParallelPlan:
    """Degrees of the mesh (one per registry mesh key: pp stages, dp replicas, tp, the dom
    tile grid, ...), the dimensions whose transform runs, and the flavour that keeps the dp
    replicas in step. ``name`` is what summaries and checkpoints call it: the shorthand
    strategy for one-dimensional plans, ``domain+zero3``-style when composed.

    Built as ``ParallelPlan(pp=2, dp=2, pipeline=True, flavour="zero1", name=...)``: a mesh
    key gives its degree (default 1), a dimension's strategy whether its transform runs
    (even at degree 1: ``--strategy pipeline`` on one rank is one stage). Both read back as
    attributes (``plan.pp``, ``plan.dom``, ``plan.dom_size``, ``plan.pipeline``)."""

    dims: tuple  # (mesh key, degree) in rank order; a grid key's degree is its shape
    applied: frozenset  # the strategies of the dimensions whose transform runs
    flavour: str
    name: str

    def __init__(self, flavour: str = "ddp", name: str = "single", **dims):
        degrees = {k: (1,) if k in registry.GRID_KEYS else 1 for k in registry.MESH_KEYS}
        applied = set()
        for key, value in dims.items():
            if key in degrees:
                degrees[key] = tuple(value) if key in registry.GRID_KEYS else value
            elif key in _STRATEGIES:
                if value:
                    applied.add(key)
            else:
                raise TypeError(f"ParallelPlan: unknown dimension {key!r}; expected a mesh key "
                                f"({', '.join(registry.MESH_KEYS)}) or a dimension's strategy "
                                f"({', '.join(_STRATEGIES)})")
        object.__setattr__(self, "dims", tuple(degrees.items()))
        object.__setattr__(self, "applied", frozenset(applied))
        object.__setattr__(self, "flavour", flavour)
        object.__setattr__(self, "name", name)

    def __getattr__(self, name: str):
        # Only what the fields do not hold: never a field itself (copy and pickle look
        # attributes up before the fields are set).
        if name in ("dims", "applied", "flavour", "name") or name.startswith("__"):
            raise AttributeError(name)
        degrees = dict(self.dims)
        if name in degrees:
            return degrees[name]
        if name in _STRATEGIES:
            return name in self.applied
        if name.endswith("_size") and name[:-len("_size")] in registry.GRID_KEYS:
            return math.prod(degrees[name[:-len("_size")]])
        raise AttributeError(f"ParallelPlan has no attribute {name!r}; its dimensions are the "
                             f"mesh keys {', '.join(registry.MESH_KEYS)} and the strategies "
                             f"{', '.join(_STRATEGIES)}")

    def degree(self, key: str) -> int:
        """Ranks along mesh key ``key`` (a grid: the product of its shape)."""
        return self.layout.degrees()[key]

    @property
    def world_size(self) -> int:
        return math.prod(self.layout.degrees().values())

    @property
    def layout(self) -> MeshLayout:
        """The mesh layout (rank order: see runtime/mesh.py)."""
        return MeshLayout(**dict(self.dims))

    @property
    def batch_ranks(self) -> int:
        """Ranks that split each micro-batch's samples: the dp replicas (pp stages and dom
        tiles of one replica see the same samples)."""
        return self.dp

    def uses(self, strategy: str) -> bool:
        """Whether the plan applies the dimension's transform (registry.DIMENSIONS)."""
        return getattr(self, strategy)

    def transforms(self) -> list[str]:
        """The transforms the orchestrator applies, in its fixed order."""
        out = [d.strategy for d in registry.by_transform_order() if self.uses(d.strategy)]
        if self.name != "single":
            out.append(self.flavour)
        return out

    def _above_one(self) -> list[tuple[str, str]]:
        """(key, degree as --mesh writes it) of the degrees above 1, in rank order."""
        sizes = self.layout.degrees()
        return [(k, "x".join(map(str, v)) if k in registry.GRID_KEYS else str(v))
                for k, v in self.dims if sizes[k] > 1]

    def mesh_text(self) -> str:
        """The degrees above 1 in mesh order, e.g. 'pp=2,dp=2' or 'dp=2,dom=2x2' ('dp=1':
        one rank); ``--mesh`` reads it back."""
        return ",".join(f"{k}={v}" for k, v in self._above_one()) or "dp=1"

    def describe(self) -> str:
        above = self._above_one()  # the integer degrees first, then the grids
        dims = [f"{k}={v}" for k, v in above if k not in registry.GRID_KEYS] + \
               [f"{k}={v}" for k, v in above if k in registry.GRID_KEYS]
        return f"{self.name} ({' x '.join(dims) or 'one rank'}; dp flavour {self.flavour})"


def _flavour_of(strategy: str, dp_flavour: str, pipeline_dp_sharding: str) -> str:
    if strategy in registry.FLAVOUR_NAMES:
        if dp_flavour and dp_flavour != strategy:
            raise PlanError(f"--strategy {strategy} and --dp-flavour {dp_flavour} name different "
                            f"data-parallel flavours; give one of them")
        return strategy
    if strategy == "pipeline" and pipeline_dp_sharding != "ddp":
        if dp_flavour and dp_flavour != pipeline_dp_sharding:
            raise PlanError(f"pipeline.dp_sharding = {pipeline_dp_sharding!r} and --dp-flavour "
                            f"{dp_flavour} disagree; give one of them")
        return pipeline_dp_sharding
    return dp_flavour or "ddp"


def build_plan(strategy: str, mesh: str, world_size: int, dp_flavour: str = "",
               pipeline_dp_sharding: str = "ddp") -> ParallelPlan:
    """The plan of a run: the strategy shorthand, the mesh and the flavour (PlanError when
    it cannot run at this world size)."""
    if dp_flavour and dp_flavour not in registry.FLAVOUR_NAMES:
        raise PlanError(f"--dp-flavour {dp_flavour!r}: expected one of "
                        f"{', '.join(registry.FLAVOUR_NAMES)}")
    composing = bool(mesh) or bool(dp_flavour)
    if strategy == "single" and not composing:
        if world_size > 1:
            raise PlanError(
                f"train.strategy = 'single' but the launcher started {world_size} ranks; each "
                f"rank would train alone. Use --strategy ddp (or another parallel strategy), "
                f"--mesh/--dp-flavour, or launch one process")
        return ParallelPlan(name="single")
    flavour = _flavour_of(strategy, dp_flavour, pipeline_dp_sharding)
    text = mesh or registry.default_mesh(strategy, world_size)
    try:
        layout = MeshLayout.parse(text).resolve(world_size)
    except ValueError as exc:
        raise PlanError(f"runtime.mesh = {mesh!r}: {exc}") from None
    why = registry.composition_error(strategy, layout, mesh)
    if why:
        raise PlanError(why)
    degrees = layout.degrees()
    on = {d.strategy: degrees[d.key] > 1 or strategy == d.strategy for d in registry.DIMENSIONS}
    parts = [name for name, used in on.items() if used]
    if not parts:
        name = flavour
    elif strategy == "pipeline" or (strategy in on and flavour == "ddp"):
        name = "+".join(parts)  # the shorthand keeps its name (pipeline: any dp flavour)
    else:
        name = "+".join(parts + [flavour])
    return ParallelPlan(flavour=flavour, name=name, **layout._fields(), **on)
