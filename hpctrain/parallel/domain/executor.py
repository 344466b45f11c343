"""The domain transform: every sample's grid is split over the mesh's dom ranks.

Weights are replicated over dom; each rank computes its tile of every layer (halo exchanges
inside the layers) and the loss of its tile, weighted by the tile's share of the grid, so
the sum over the domain group is the loss of the full grid. The gradient of each weight is
thus PARTIAL over the dom group: the data-parallel flavour that the orchestrator applies
next sums it over dom as well as over the dp replicas (``DomainExecutor.partial_groups``).
This module owns only what is domain-specific: the layers, the tiles each rank reads, and
the loss weighting (``DomainExecutor``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctrain.parallel.domain.convert import to_domain
from hpctrain.parallel.domain.decomposition import grid_shape_for
from hpctrain.parallel.domain.functional import DomainFunctions, check, spatial_ndim
from hpctrain.parallel.domain.halo import DomainGrid
from hpctrain.parallel.domain.options import DomainOptions
from hpctrain.parallel.placement import Copies, place, placement_of
from hpctrain.runtime.abort import set_context

__all__ = ["DomainOptions", "DomainExecutor", "prepare"]


class DomainExecutor:
    """Runs forward/backward on this rank's tiles and reads only those tiles."""

    def __init__(self, grid: DomainGrid, dp_rank: int, dp_size: int,
                 functions: DomainFunctions):
        self.grid = grid
        # The forward's own ops on tiles: made exact or refused (functional.py).
        self.functions = functions
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._shapes = None  # global spatial shapes of the current batch's (x, y)

    @property
    def partial_groups(self) -> list:
        """Groups over which a weight's gradient is partial (summed by the dp flavour)."""
        return [self.grid.comm] if self.grid.comm.size > 1 else []

    def data_shard(self, world) -> tuple[int, int]:
        """Samples are split over dp only; the dom ranks of a dp group share them (local)."""
        return self.dp_rank, self.dp_size

    def load_batch(self, dataset, indices):
        """Read this rank's tile of each sample (hyperslabs only when the data set can); local."""
        nd = self.grid.ndim
        if hasattr(dataset, "read_tile") and hasattr(dataset, "spatial_shape"):
            glob = tuple(dataset.spatial_shape)
            lo, hi = self.grid.tile(glob)
            x, y = dataset.read_tile(indices, lo, hi)
            self._shapes = (glob, glob)
            return x, y
        from hpctrain.data.sampler import collate

        x, y = collate(dataset, indices)
        gx, gy = tuple(x.shape[-nd:]), tuple(y.shape[-nd:])
        self._shapes = (gx, gy)
        return self.crop(x, gx), self.crop(y, gy)

    def crop(self, t, glob):
        """This rank's tile of t, whose trailing dims are the global grid ``glob``."""
        lo, hi = self.grid.tile(glob)
        return t[(Ellipsis,) + tuple(slice(a, b) for a, b in zip(lo, hi))].contiguous()

    def set_global_shapes(self, x_shape: tuple, y_shape: tuple) -> None:
        """The global grids of the batch whose tiles forward_backward gets next."""
        self._shapes = (tuple(x_shape), tuple(y_shape))

    def forward_backward(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """Each micro-batch's loss on this rank's tiles, weighted by the tile's share of the
        grid (collective: halo exchanges); the dp flavour ``dp_part`` owns the backward."""
        model, backward, local = dp_part.model, dp_part.backward, 0.0
        for x, y, weight in micro_batches:
            gx, gy = self._shapes
            # Layer shapes depend only on the global input grid: cache the shape lookups.
            self.grid.begin(gx)
            set_context(phase="forward")  # named in flight records, stall reports, timeline
            try:
                with precision.autocast():
                    loss = loss_fn(self._forward(model, x), y)
            finally:
                self.grid.end()
            nd = self.grid.ndim
            share = math.prod(y.shape[-nd:]) / math.prod(gy)  # mean over the tile -> over the grid
            set_context(phase="backward")
            backward(precision.scale(loss * (share * weight)))
            local += float(loss.detach()) * share * weight
        return local

    def _forward(self, model, x):
        """model(x) on this rank's tile x, its functional ops followed (functional.py)."""
        with self.functions:
            return model(self.functions.split(x))

    def forward_loss(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """Evaluation: each micro-batch's loss on this rank's tiles, weighted by the tiles'
        share of the grid, without a backward (collective: halo exchanges; an empty
        micro-batch is forwarded too, adding no loss)."""
        model, local, nd = dp_part.model, 0.0, self.grid.ndim
        with torch.no_grad():
            for x, y, weight in micro_batches:
                gx, gy = self._shapes
                self.grid.begin(gx)
                try:
                    with precision.autocast():
                        out = self._forward(model, x)
                        if x.shape[0]:
                            loss = float(loss_fn(out, y))
                finally:
                    self.grid.end()
                if x.shape[0]:
                    local += loss * math.prod(y.shape[-nd:]) / math.prod(gy) * weight
        return local


def prepare(model: nn.Module, world, mesh, options: DomainOptions | None = None, sample=None):
    """Make model's spatial layers domain parallel over ``mesh.comm("dom")``; return (model,
    executor). Collective over the world (BatchNorm statistics span every rank that holds
    part of the global batch: dom times dp, the whole world while pp = tp = 1). ``sample``:
    an input of whole grids to check the forward's ops on first (the Python API; the
    trainer checks them before MPI, train/checked.py)."""
    opts = options or DomainOptions()
    shape = grid_shape_for(mesh.layout.dom, spatial_ndim(model))  # fails on every rank alike
    if mesh.size("pp") > 1 or mesh.size("tp") > 1:
        raise ValueError(f"mesh {mesh.layout.describe()}: the domain transform composes with dp "
                         "only (pp = tp = 1)")
    grid = DomainGrid(mesh.comm("dom"), shape)
    model.to(world.device)
    if sample is not None:  # every op of the forward, on whole grids: fails on every rank
        check(model, sample.to(world.device))
    with torch.no_grad():  # identical start everywhere, whatever the user's init did
        for t in model.state_dict().values():
            world.comm.broadcast(t, root=0)
    model = to_domain(model, grid, world.comm, overlap=opts.overlap)
    functions = DomainFunctions(grid.ndim, grid, opts.overlap)
    functions.watch(model, check=False)  # the layers' own ops are theirs
    # Every tile holds every weight whole; each gets the gradient of its own tile.
    for t in list(model.parameters()) + list(model.buffers()):
        place(t, placement_of(t).with_copies(Copies("dom", grid.comm, partial=True)))
    return model, DomainExecutor(grid, mesh.coords["dp"], mesh.size("dp"), functions)
