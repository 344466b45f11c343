"""The ``domain`` strategy: every sample's grid is split over the mesh's dom ranks.

Weights are replicated; each rank computes its tile of every layer (halo exchanges inside
the layers) and the loss of its tile, weighted by the tile's share of the grid, so the sum
over the domain group is the loss of the full grid. Gradients are summed over all ranks that
hold part of the global batch (dom times dp), as in one process on the full grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.parallel.base import OptimizerFactory, Parallelized
from hpctrain.parallel.domain.convert import to_domain
from hpctrain.parallel.domain.decomposition import grid_shape_for
from hpctrain.parallel.domain.halo import DomainGrid

__all__ = ["DomainOptions", "DomainParallel", "wrap", "domain_layout"]


@dataclass(frozen=True)
class DomainOptions:
    """The mesh ('' = all ranks in one domain group) and whether to overlap halos with compute."""

    mesh: str = ""
    overlap: bool = False


def domain_layout(mesh: str, world_size: int):
    """The MeshLayout the domain strategy uses: '' means dom = all ranks, dp = 1."""
    from hpctrain.runtime.mesh import MeshLayout

    layout = MeshLayout.parse(mesh) if mesh else MeshLayout(dp=1, dom=(world_size,))
    return layout.resolve(world_size)


class DomainParallel(Parallelized):
    name = "domain"

    def __init__(self, model, optimizer, grid: DomainGrid, batch_comm, dp_rank: int, dp_size: int,
                 job_comm=None):
        super().__init__(model, optimizer, job_comm)
        self.grid = grid
        self.batch_comm = batch_comm
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._shapes = None  # global spatial shapes of the current batch's (x, y)

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
        return self._crop(x, gx), self._crop(y, gy)

    def _crop(self, t, glob):
        lo, hi = self.grid.tile(glob)
        return t[(Ellipsis,) + tuple(slice(a, b) for a, b in zip(lo, hi))].contiguous()

    def forward_backward(self, micro_batches, loss_fn, precision) -> float:
        """Each micro-batch's loss on this rank's tiles, weighted by the tile's share of the
        grid (collective: halo exchanges)."""
        local = 0.0
        for x, y, weight in micro_batches:
            gx, gy = self._shapes
            # Layer shapes depend only on the global input grid: cache the shape lookups.
            self.grid.begin(gx)
            try:
                with precision.autocast():
                    loss = loss_fn(self.model(x), y)
            finally:
                self.grid.end()
            nd = self.grid.ndim
            share = math.prod(y.shape[-nd:]) / math.prod(gy)  # mean over the tile -> over the grid
            self.backward(precision.scale(loss * (share * weight)))
            local += float(loss.detach()) * share * weight
        return local

    def _sync_grads(self) -> None:
        comm = self.batch_comm
        if comm.size == 1 or not self._trainable:
            return
        had = torch.tensor([p.grad is not None for p in self._trainable], dtype=torch.uint8)
        comm.allreduce(had, op="max")
        params = [p for p, f in zip(self._trainable, had.tolist()) if f]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        comm.allreduce(flat, op="sum")  # one message for all gradients
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


def _spatial_ndim(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            return len(m.kernel_size)
    raise ValueError("domain parallel found no Conv1d/2d/3d in the model, so it cannot tell "
                     "how many spatial dims to split; use a convolutional model")


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world,
         options: DomainOptions | None = None) -> Parallelized:
    """Split every sample's grid over the dom ranks of the mesh (collective over the world)."""
    opts = options or DomainOptions()
    layout = domain_layout(opts.mesh, world.size)
    shape = grid_shape_for(layout.dom, _spatial_ndim(model))  # fails on every rank alike
    if layout.pp > 1 or layout.tp > 1:
        raise ValueError(f"mesh {layout.describe()}: the domain strategy uses dp and dom only")
    mesh = world.mesh(layout)
    grid = DomainGrid(mesh.comm("dom"), shape)
    model.to(world.device)
    with torch.no_grad():  # identical start everywhere, whatever the user's init did
        for t in model.state_dict().values():
            world.comm.broadcast(t, root=0)
    # pp = tp = 1, so the ranks holding parts of the global batch are the whole world.
    model = to_domain(model, grid, world.comm, overlap=opts.overlap)
    return DomainParallel(model, make_optimizer(model.parameters()), grid, world.comm,
                          mesh.coords["dp"], mesh.size("dp"), world.host)
