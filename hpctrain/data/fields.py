"""2D physical fields from a reaction-diffusion simulation, stored in HDF5, read by tiles.

The toolkit runs the simulation itself (Fisher-KPP, u_t = D lap u + r u (1 - u), periodic
grid, explicit Euler) to make samples: input = the field at t0, target = the field a few
steps later. A domain-parallel rank reads ONLY the hyperslab of its tile from the file.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import Dataset

from .synthetic import seeded_generator

__all__ = ["FieldsDataset", "simulate", "make_fields_file"]


def _laplacian(u: torch.Tensor) -> torch.Tensor:
    return (torch.roll(u, 1, -1) + torch.roll(u, -1, -1) + torch.roll(u, 1, -2)
            + torch.roll(u, -1, -2) - 4 * u)


def simulate(n_samples: int, shape: tuple[int, int], seed: int, steps: int = 8,
             diffusion: float = 0.2, rate: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Return (inputs, targets), each float32 of shape (n_samples, 1, H, W)."""
    g = seeded_generator(seed, 3)
    u = torch.rand((n_samples, 1) + tuple(shape), generator=g, dtype=torch.float64)
    for _ in range(4):  # smooth the noise into blobs first
        u = u + 0.24 * _laplacian(u)
    u = (u - u.amin((-2, -1), keepdim=True)) / (u.amax((-2, -1), keepdim=True)
                                                - u.amin((-2, -1), keepdim=True) + 1e-12)
    x = u.clone()
    for _ in range(steps):
        u = u + diffusion * _laplacian(u) + rate * 0.1 * u * (1 - u)
    return x.float().numpy(), u.float().numpy()


def make_fields_file(path: str, n_samples: int, shape: tuple[int, int], seed: int) -> str:
    """Write the simulated samples to ``path`` (atomically: ranks may race) unless present."""
    if os.path.exists(path):
        return path
    import h5py

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    x, y = simulate(n_samples, shape, seed)
    tmp = f"{path}.{os.getpid()}.tmp"
    with h5py.File(tmp, "w") as f:
        f.create_dataset("inputs", data=x, chunks=(1, 1) + x.shape[2:])
        f.create_dataset("targets", data=y, chunks=(1, 1) + y.shape[2:])
        f.attrs["simulation"] = "Fisher-KPP reaction-diffusion, periodic, explicit Euler"
    os.replace(tmp, path)  # same content from every writer: the last rename wins harmlessly
    return path


class FieldsDataset(Dataset):
    """Map-style (input, target) fields from an HDF5 file; ``read_tile`` reads hyperslabs."""

    def __init__(self, path: str):
        import h5py

        self.path = path
        with h5py.File(path, "r") as f:
            self._len = f["inputs"].shape[0]
            self.spatial_shape = tuple(f["inputs"].shape[2:])
        self._file = None

    def _f(self):
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r")
        return self._file

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        f = self._f()
        return torch.from_numpy(f["inputs"][int(i)]), torch.from_numpy(f["targets"][int(i)])

    def read_tile(self, indices, lo: tuple[int, ...], hi: tuple[int, ...]):
        """Stack samples' boxes [lo, hi) of inputs and targets: only those bytes are read."""
        f = self._f()
        box = (slice(None),) + tuple(slice(a, b) for a, b in zip(lo, hi))
        xs = [f["inputs"][(int(i),) + box] for i in indices]
        ys = [f["targets"][(int(i),) + box] for i in indices]
        if not xs:
            shape = (0, 1) + tuple(b - a for a, b in zip(lo, hi))
            return torch.empty(shape), torch.empty(shape)
        return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))
