"""[domain]: the options of domain (spatial) parallel (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.option import option

__all__ = ["DomainOptions"]


@dataclass
class DomainOptions:
    """Whether to overlap halos with compute (the mesh comes from the ParallelPlan)."""

    # Off by default: with MPI on CPU a message moves only inside MPI calls, so the interior
    # computed "while halos fly" hides ~0.1 ms per layer and the split conv + concatenation
    # costs more (bench halo). Worth trying where communication progresses by itself (NCCL).
    overlap: bool = option(False, "compute the tile interior while halos are in flight")
