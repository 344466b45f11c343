"""The parallel plan: mesh degrees + the data-parallel flavour, built and validated once.

Pure (no torch, no MPI): every rank builds the same plan from the same config and world
size, so a plan that cannot run fails on every rank alike, before any collective. The
orchestrator (``orchestrator.py``) is the only reader that turns it into transforms.

``--strategy NAME`` is a shorthand for a one-dimensional plan (``zero3`` = every rank a dp
replica with flavour zero3, ``pipeline`` = every rank a stage, ``domain`` = every rank a
tile, ``tensor`` = every rank a tensor-parallel slice); ``--mesh`` and ``--dp-flavour`` spell a composed one (``--mesh dom=2,dp=2
--dp-flavour fsdp``). A flavour strategy given with a mesh composes too: ``--strategy zero3
--mesh dom=2,dp=2`` is the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.runtime.mesh import MeshLayout

from hpctrain.parallel import registry

__all__ = ["ParallelPlan", "PlanError", "build_plan"]


class PlanError(ValueError):
    """The plan cannot run; the message says which degree or flavour and what to do."""


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of the mesh (pp stages, dp replicas, tp, dom tile grid) and the flavour that
    keeps the dp replicas in step. ``name`` is what summaries and checkpoints call it: the
    shorthand strategy for one-dimensional plans, ``domain+zero3``-style when composed."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dom: tuple = (1,)
    flavour: str = "ddp"
    name: str = "single"
    # The transform runs even at degree 1 (``--strategy pipeline`` on one rank is one stage).
    pipeline: bool = False
    domain: bool = False
    tensor: bool = False

    @property
    def dom_size(self) -> int:
        return self.layout.dom_size

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp * self.dom_size

    @property
    def layout(self) -> MeshLayout:
        """The mesh layout (rank order: see runtime/mesh.py)."""
        return MeshLayout(pp=self.pp, dp=self.dp, dom=tuple(self.dom), tp=self.tp)

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

    def mesh_text(self) -> str:
        """The degrees above 1 in mesh order, e.g. 'pp=2,dp=2' or 'dp=2,dom=2x2' ('dp=1':
        one rank); ``--mesh`` reads it back."""
        parts = [f"{k}={v}" for k, v in (("pp", self.pp), ("dp", self.dp)) if v > 1]
        if self.dom_size > 1:
            parts.append("dom=" + "x".join(map(str, self.dom)))
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        return ",".join(parts) or "dp=1"

    def describe(self) -> str:
        dims = [f"{k}={v}" for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
                if v > 1]
        if self.dom_size > 1:
            dims.append("dom=" + "x".join(map(str, self.dom)))
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
    return ParallelPlan(pp=layout.pp, dp=layout.dp, tp=layout.tp, dom=tuple(layout.dom),
                        flavour=flavour, name=name, **on)
