"""The device mesh: named parallel dimensions whose product is the world size.

Rank order is row-major over (pp, dp, dom, tp): tp varies fastest so tensor-parallel
partners sit on the same node, pp slowest so pipeline stages span nodes, where their
point-to-point traffic is lightest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep layout parsing importable without torch (config checks)
    from hpctrain.runtime.comm import Communicator

__all__ = ["DIMS", "MeshLayout", "Mesh"]

DIMS = ("pp", "dp", "dom", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Degrees of each mesh dimension; -1 (at most one) means 'infer from the world size'.

    ``dom`` is a shape: the Cartesian grid of ranks over the spatial dimensions, e.g. (2, 2).
    """

    pp: int = 1
    dp: int = -1
    dom: tuple[int, ...] = (1,)
    tp: int = 1

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
            if name != "dom" and len(degrees) != 1:
                raise ValueError(f"mesh {text!r}: only dom takes a grid shape like 2x2, got {name}={value}")
            kwargs[name] = degrees if name == "dom" else degrees[0]
        if "dp" not in kwargs and any(k in kwargs for k in ("pp", "dom", "tp")):
            kwargs["dp"] = -1
        return cls(**kwargs)

    @property
    def dom_size(self) -> int:
        return math.prod(self.dom)

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "dom": self.dom_size, "tp": self.tp}

    def describe(self) -> str:
        d = self.degrees()
        parts = [f"{k}={'x'.join(map(str, self.dom)) if k == 'dom' else v}" for k, v in d.items()]
        return ",".join(parts)

    def resolve(self, world_size: int) -> "MeshLayout":
        """Fill in an inferred degree and check the product equals world_size (ValueError if not)."""
        degrees = self.degrees()
        shown = f"{self.describe()} for world size {world_size}"
        bad = [k for k, v in degrees.items() if v == 0 or v < -1]
        if bad or any(x < 1 for x in self.dom if len(self.dom) > 1):
            raise ValueError(f"mesh {shown}: degrees must be positive (or -1 to infer)")
        inferred = [k for k, v in degrees.items() if v == -1]
        if len(inferred) > 1 or (len(self.dom) > 1 and -1 in self.dom):
            raise ValueError(f"mesh {shown}: at most one scalar degree may be -1")
        known = math.prod(v for v in degrees.values() if v != -1)
        if inferred:
            if world_size % known:
                # Name what the user gave, not the internal -1 of the inferred degree.
                given = ",".join(f"{k}={'x'.join(map(str, self.dom)) if k == 'dom' else v}"
                                 for k, v in degrees.items() if v not in (1, -1)) or "(none)"
                raise ValueError(f"mesh {given} for world size {world_size}: the degrees "
                                 f"given multiply to {known}, which does not divide "
                                 f"{world_size} ranks, the number launched ({inferred[0]} is "
                                 f"inferred from the rest); launch a multiple of {known} "
                                 f"ranks or change the degrees")
            value = world_size // known
            return MeshLayout(**{**self._fields(), **({inferred[0]: value} if inferred[0] != "dom"
                                                      else {"dom": (value,)})})
        if known != world_size:
            raise ValueError(f"mesh {shown}: the degrees multiply to {known}, not {world_size}; "
                             f"launch {known} ranks or change the degrees (one may be -1)")
        return self

    def _fields(self) -> dict:
        return {"pp": self.pp, "dp": self.dp, "dom": self.dom, "tp": self.tp}


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
        """Return the sub-communicator along ``dim`` (pp, dp, dom or tp)."""
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
