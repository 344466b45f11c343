"""Where each parameter lives on the mesh, and the rules that follow from it.

A ``Placement`` describes one tensor as this rank holds it:

- ``global_shape`` and ``offset``: the global tensor it is (a slice of), and where the slice
  starts (a model-parallel split along a tensor dim, e.g. a tensor-parallel column slice;
  ``None``: the whole tensor); ``sliced_over``: the groups holding the other slices;
- ``copies``: the groups whose ranks hold the SAME values (``Copies``), each saying whether
  their gradients are partial sums (the data-parallel replicas see different samples, the
  tiles of a domain split different parts of each sample, the stages holding a tied weight
  different uses of it) or already the same (a tensor-parallel layer's replicated bias).

Model-parallel transforms place the parameters they split or replicate (``place``); the
data-parallel flavour adds its replicas and asks this module, and nothing else:

- which groups to sum a gradient over (``Placement.sum_comms``);
- over which ranks "did any rank get a gradient" is agreed (the ``copies``);
- how much a rank's squares count in a global norm (``Placement.norm_weight``: every
  distinct element counts once however many ranks hold it; ``global_norm``);
- what a checkpoint entry holds: the N-D box of the global tensor and, for a flat shard of
  it, its elements, with the copies splitting the writing (``entry``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

__all__ = ["Copies", "Placement", "place", "placement_of", "carry_placements", "global_norm",
           "entry"]

_ATTR = "_hpctrain_placement"


@dataclass(frozen=True)
class Copies:
    """A group of ranks holding the same values of a tensor; ``partial``: their gradients
    are partial sums (summed by the gradient sync), else already equal; ``at_step``: summed
    only at the step, after every rank's schedule (its ranks run different pipeline stages,
    which are at different actions mid-schedule)."""

    name: str
    comm: object = field(compare=False, repr=False)
    partial: bool = True
    at_step: bool = False

    @property
    def size(self) -> int:
        return self.comm.size


@dataclass(frozen=True)
class Placement:
    """One tensor's place on the mesh (see the module docstring)."""

    global_shape: tuple
    offset: tuple | None = None
    copies: tuple = ()
    # The groups whose ranks hold the OTHER slices (tensor parallel: the tp group); a value
    # that goes with the whole tensor (Adam's step count) is held alike by them too.
    sliced_over: tuple = ()
    # A slice that is one box only in another shape of the same row-major elements: a fused
    # qkv weight (3h, d) split by whole heads is the box offset (0, r*h/tp, 0) count
    # (3, h/tp, d) of the view (3, h, d). ``view``: (view shape, box count in it).
    view: tuple | None = None

    def with_copies(self, *more: Copies) -> "Placement":
        """This placement, also held alike by the ranks of ``more`` (size-1 groups dropped)."""
        return replace(self, copies=self.copies + tuple(c for c in more if c.size > 1))

    def scalar(self, shape: tuple = ()) -> "Placement":
        """The placement of a per-tensor value (Adam's step): held alike by the copies and
        by the ranks holding the other slices."""
        return Placement(tuple(shape), copies=self.copies + self.sliced_over)

    @property
    def n_copies(self) -> int:
        return math.prod(c.size for c in self.copies)

    @property
    def norm_weight(self) -> float:
        """A rank's share of this tensor's squares in a norm summed over every rank."""
        return 1.0 / self.n_copies

    def sum_comms(self) -> list:
        """The groups a gradient is summed over (its partial copies)."""
        return [c.comm for c in self.copies if c.partial]

    def copy_index(self) -> tuple[int, int]:
        """(this rank's index, how many) among the ranks holding these same values."""
        index, count = 0, 1
        for c in self.copies:
            index, count = index * c.size + c.comm.rank, count * c.size
        return index, count

    def box(self, local_shape: tuple) -> tuple | None:
        """(offset, count) of the global tensor the local one is, or (offset, count, view
        shape) for a box of a view (see ``view``); None when whole."""
        if self.offset is None:
            return None
        if self.view is not None:
            shape, count = self.view
            return tuple(self.offset), tuple(count), tuple(shape)
        return tuple(self.offset), tuple(local_shape)


def place(tensor: torch.Tensor, placement: Placement) -> None:
    """Record a model-parallel transform's placement of ``tensor`` (kept with it)."""
    setattr(tensor, _ATTR, placement)


def placement_of(tensor: torch.Tensor) -> Placement:
    """The tensor's recorded placement; the whole tensor, held by this rank alone, if none."""
    p = getattr(tensor, _ATTR, None)
    return p if p is not None else Placement(tuple(tensor.shape))


def n_copies_of(tensor: torch.Tensor) -> int:
    """``placement_of(tensor).n_copies`` without building a Placement (per-step paths)."""
    p = getattr(tensor, _ATTR, None)
    return p.n_copies if p is not None else 1


def carry_placements(old, new) -> None:
    """Give the tensors of module ``new`` the placements of ``old``'s under the same
    state_dict keys (a layer swapped for another, e.g. SyncBatchNorm)."""
    fresh = new.state_dict(keep_vars=True)
    for key, t in old.state_dict(keep_vars=True).items():
        p = getattr(t, _ATTR, None)
        if p is not None and key in fresh:
            place(fresh[key], p)


def global_norm(terms, comm) -> float:
    """sqrt of the sum over every rank of ``comm`` (the job) of weight * |tensor|^2 for
    ``terms`` = (tensor, weight) pairs: with weight = Placement.norm_weight each distinct
    element counts once, however the tensors are sharded and replicated (collective)."""
    sq = _weighted_squares(terms)
    if comm is not None and comm.size > 1:
        sq = comm.allreduce_scalars([sq])[0]
    return math.sqrt(sq)


def _weighted_squares(terms) -> float:
    """sum of weight * |tensor|^2 in float64, with ONE host read per device: a read per
    tensor is a GPU sync per tensor (about 150 a step for a 12-layer GPT)."""
    terms = [(t.detach(), w) for t, w in terms]
    by_device: dict = {}
    for i, (t, _) in enumerate(terms):
        by_device.setdefault(t.device, []).append(i)
    squares = [0.0] * len(terms)
    for indices in by_device.values():
        tensors = [terms[i][0] for i in indices]
        try:  # one multi-tensor kernel per dtype, accumulated in float64
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
            values = torch.stack(norms).square().tolist()
        except (RuntimeError, TypeError):  # a torch without it: the same, tensor by tensor
            values = torch.stack([t.double().pow(2).sum() for t in tensors]).tolist()
        for i, v in zip(indices, values):
            squares[i] = v
    return sum(v * w for v, (_, w) in zip(squares, terms))


def entry(name: str, local: torch.Tensor, placement: Placement, elems: tuple | None = None,
          job_size: int | None = None, local_shape: tuple | None = None):
    """The checkpoint Entry of ``local`` (this rank's part of ``placement``'s global tensor;
    ``elems``: a flat shard, those elements of the row-major flattened local tensor, whose
    shape is ``local_shape``).

    The copies split the writing: each writes a contiguous share of the part they all hold.
    A whole tensor held alike by every rank of the job is left to the writer, which splits
    it over all ranks by checksum blocks."""
    from hpctrain.checkpoint.layout import Entry

    shape, dtype = tuple(placement.global_shape), local.dtype
    if elems is not None and local_shape is None and placement.offset is not None:
        raise ValueError(f"{name}: a flat shard of a slice needs the slice's local_shape")
    box = placement.box(tuple(local_shape if local_shape is not None else local.shape))
    if box is None and elems is None and placement.n_copies == (job_size or 1):
        return Entry(name, shape, dtype, local.detach())
    if box is None and not shape:  # a scalar: the first copy writes it
        write = placement.copy_index()[0] == 0
        return Entry(name, shape, dtype, local.detach().reshape(-1)[:int(write)],
                     elems=(0, int(write)))
    flat = local.detach().reshape(-1)
    lo, hi = elems if elems is not None else (0, flat.numel())
    base = 0 if elems is None else lo  # where flat's first element sits in the local tensor
    if elems is not None and flat.numel() != hi - lo:
        raise ValueError(f"{name}: elements {elems} hold {hi - lo} values, the local flat "
                         f"tensor {flat.numel()}")
    index, count = placement.copy_index()
    a = lo + (hi - lo) * index // count
    b = lo + (hi - lo) * (index + 1) // count
    part = flat[a - base:b - base]
    if box is None:
        return Entry(name, shape, dtype, part, elems=(a, b))
    return Entry(name, shape, dtype, part, box=box, elems=(a, b))

