"""The device mesh: named parallel dimensions whose product is the world size.

The keys, their rank order and which take a grid shape are the registry's (MESH_KEYS):
rank order is row-major over (pp, dp, dom, tp): tp varies fastest so tensor-parallel
partners sit on the same node, pp slowest so pipeline stages span nodes, where their
point-to-point traffic is lightest.
"""

from __future__ import annotations

import dataclasses
import math

from typing import TYPE_CHECKING

from hpctrain.registry import DP_KEY, GRID_KEYS, MESH_KEYS

if TYPE_CHECKING:  # keep layout parsing importable without torch (config checks)
    from hpctrain.runtime.comm import Communicator

__all__ = ["DIMS", "MeshLayout", "Mesh"]

#: The mesh keys in rank order (the registry's).
DIMS = MESH_KEYS


def _shown(key: str, value) -> str:
    return "x".join(map(str, value)) if key in GRID_KEYS else str(value)


class _Layout:
    """The methods of MeshLayout (its fields are the registry's mesh keys)."""

    @classmethod
    def parse(cls, text: str) -> "MeshLayout":
        """Parse 'dp=2,pp=2,dom=2x2,tp=1'; missing dimensions keep their defaults."""
        kwargs: dict = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in DIMS:
                raise ValueError(f"mesh {text!r}: bad entry {part!r}; expected NAME=DEGREE with "
                                 f"NAME in {', '.join(DIMS)}, e.g. 'dp=2,pp=2' or 'dom=2x2'")
            if name in kwargs:
                raise ValueError(f"mesh {text!r}: {name} given twice")
            try:
                degrees = tuple(int(v) for v in value.strip().lower().split("x"))
            except ValueError:
                raise ValueError(f"mesh {text!r}: {name}={value!r} is not an integer degree") from None
            if name not in GRID_KEYS and len(degrees) != 1:
                grids = " and ".join(GRID_KEYS) + (" takes" if len(GRID_KEYS) == 1 else " take")
                raise ValueError(f"mesh {text!r}: only {grids} a grid shape like 2x2, got "
                                 f"{name}={value}")
            kwargs[name] = degrees if name in GRID_KEYS else degrees[0]
        return cls(**kwargs)

    def __getattr__(self, name: str):
        # ``layout.dom_size``: the ranks of a grid dimension (the product of its shape)
        key = name[:-len("_size")] if name.endswith("_size") else ""
        if key in GRID_KEYS:
            return math.prod(getattr(self, key))
        raise AttributeError(f"MeshLayout has no attribute {name!r}; its keys are "
                             f"{', '.join(DIMS)}")

    def degrees(self) -> dict[str, int]:
        """Ranks along each key, in rank order (a grid: the product of its shape)."""
        return {k: math.prod(v) if k in GRID_KEYS else v for k, v in self._fields().items()}

    def describe(self) -> str:
        return ",".join(f"{k}={_shown(k, v)}" for k, v in self._fields().items())

    def resolve(self, world_size: int) -> "MeshLayout":
        """Fill in an inferred degree and check the product equals world_size (ValueError if not)."""
        degrees = self.degrees()
        shown = f"{self.describe()} for world size {world_size}"
        grids = [getattr(self, k) for k in GRID_KEYS]
        bad = [k for k, v in degrees.items() if v == 0 or v < -1]
        if bad or any(x < 1 for g in grids if len(g) > 1 for x in g):
            raise ValueError(f"mesh {shown}: degrees must be positive (or -1 to infer)")
        inferred = [k for k, v in degrees.items() if v == -1]
        if len(inferred) > 1 or any(len(g) > 1 and -1 in g for g in grids):
            raise ValueError(f"mesh {shown}: at most one scalar degree may be -1")
        known = math.prod(v for v in degrees.values() if v != -1)
        if inferred:
            key = inferred[0]
            if world_size % known:
                # Name what the user gave, not the internal -1 of the inferred degree.
                given = ",".join(f"{k}={_shown(k, v)}" for k, v in self._fields().items()
                                 if degrees[k] not in (1, -1)) or "(none)"
                raise ValueError(f"mesh {given} for world size {world_size}: the degrees "
                                 f"given multiply to {known}, which does not divide "
                                 f"{world_size} ranks, the number launched ({key} is "
                                 f"inferred from the rest); launch a multiple of {known} "
                                 f"ranks or change the degrees")
            value = world_size // known
            return dataclasses.replace(self, **{key: (value,) if key in GRID_KEYS else value})
        if known != world_size:
            raise ValueError(f"mesh {shown}: the degrees multiply to {known}, not {world_size}; "
                             f"launch {known} ranks or change the degrees (one may be -1)")
        return self

    def _fields(self) -> dict:
        return {k: getattr(self, k) for k in DIMS}


def _field(key: str):
    # dp is inferred by default (the ranks the other degrees leave); a grid is one tile
    if key in GRID_KEYS:
        return key, tuple, dataclasses.field(default=(1,))
    return key, int, dataclasses.field(default=-1 if key == DP_KEY else 1)


_DOC = """Degrees of each mesh dimension, one field per registry mesh key
(``MeshLayout(pp=2, dp=1)``); -1 (at most one) means 'infer from the world size'.

A grid key (``dom``) is a shape: the Cartesian grid of ranks over the spatial dimensions,
e.g. (2, 2); ``layout.dom_size`` is its number of ranks.
"""

MeshLayout = dataclasses.make_dataclass("MeshLayout", [_field(k) for k in DIMS],
                                        bases=(_Layout,), frozen=True,
                                        namespace={"__module__": __name__, "__doc__": _DOC})


class Mesh:
    """Sub-communicators of a world communicator along each mesh dimension.

    Building a Mesh is collective over ``world``. ``mesh.comm("dp")`` is the group of ranks
    that differ only in their dp coordinate.
    """

    def __init__(self, world: Communicator, layout: MeshLayout):
        self.layout = layout.resolve(world.size)
        self.world = world
        self.shape = dict(self.layout.degrees())
        self.coords = self._coords(world.rank)
        self._comms: dict[str, Communicator] = {}
        for dim in DIMS:  # same order on every rank: split is collective
            color = self._rank_of({**self.coords, dim: 0})
            self._comms[dim] = world.split(color, key=self.coords[dim], name=dim)

    def _coords(self, rank: int) -> dict[str, int]:
        coords = {}
        for dim in reversed(DIMS):
            coords[dim] = rank % self.shape[dim]
            rank //= self.shape[dim]
        return coords

    def _rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim in DIMS:
            rank = rank * self.shape[dim] + coords[dim]
        return rank

    def comm(self, dim: str) -> Communicator:
        """Return the sub-communicator along ``dim`` (a mesh key: pp, dp, dom, tp, ...)."""
        if dim not in self._comms:
            raise ValueError(f"unknown mesh dimension {dim!r}; expected one of {', '.join(DIMS)}")
        return self._comms[dim]

    def size(self, dim: str) -> int:
        return self.shape[dim]

    def free(self) -> None:
        """Free the sub-communicators (collective over the world)."""
        for c in self._comms.values():
            c.free()
        self._comms.clear()
