"""Small U-Net for 2D fields, and its factory (reaction-diffusion data in HDF5)."""

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..data.fields import FieldsDataset, make_fields_file

__all__ = ["UNet", "factory", "DEFAULTS"]

DEFAULTS = dict(size=32, n_samples=64, base=8, depth=2, norm="group", periodic=True, smooth=True)


def _norm(kind: str, ch: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(min(4, ch), ch)
    if kind == "batch":
        return nn.BatchNorm2d(ch)
    raise ValueError(f"norm={kind!r}: expected 'group' or 'batch'")


def _block(ci: int, co: int, norm: str, mode: str, smooth: bool) -> nn.Sequential:
    # No conv bias before a norm: the norm removes it, so its true gradient is zero and Adam
    # would turn the rounding noise of that zero into full-size steps.
    return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1, padding_mode=mode, bias=False),
                         _norm(norm, co), _act(smooth),
                         nn.Conv2d(co, co, 3, padding=1, padding_mode=mode, bias=False),
                         _norm(norm, co), _act(smooth))


def _act(smooth: bool) -> nn.Module:
    # Smooth (SiLU) by default: ReLU kinks and max-pool ties turn fp32 rounding differences
    # between equivalent computations into discrete gradient changes.
    return nn.SiLU() if smooth else nn.ReLU()


class UNet(nn.Module):
    """Conv blocks, pool down (avg; max when not smooth), nearest-upsample up, skips, residual."""

    def __init__(self, channels=1, base=8, depth=2, norm="group", periodic=True, smooth=True):
        super().__init__()
        mode = "circular" if periodic else "zeros"
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.downs = nn.ModuleList(_block(ci, co, norm, mode, smooth) for ci, co
                                   in zip([channels] + widths[:-2], widths[:-1]))
        self.pool = nn.AvgPool2d(2) if smooth else nn.MaxPool2d(2)
        self.bottom = _block(widths[-2], widths[-1], norm, mode, smooth)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.ups = nn.ModuleList(_block(widths[i + 1] + widths[i], widths[i], norm, mode, smooth)
                                 for i in reversed(range(depth)))
        self.head = nn.Conv2d(base, channels, 1)

    def forward(self, x):
        skips, h = [], x
        for block in self.downs:
            h = block(h)
            skips.append(h)
            h = self.pool(h)
        h = self.bottom(h)
        for block, skip in zip(self.ups, reversed(skips)):
            h = block(torch.cat([self.up(h), skip], dim=1))
        return x + self.head(h)


def factory(seed=0, *, size=32, n_samples=64, base=8, depth=2, norm="group", periodic=True,
            smooth=True, data_dir=""):
    """Return (UNet, reaction-diffusion FieldsDataset in HDF5, mean squared error)."""
    if size % 2 ** depth:
        raise ValueError(f"size={size} must be divisible by 2**depth={2 ** depth} (each level "
                         "halves the grid and the skip connections must line up)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UNet(1, base, depth, norm, periodic, smooth)
    root = data_dir or os.environ.get("HPCTRAIN_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hpctrain")
    path = make_fields_file(os.path.join(root, f"fields-{size}x{size}-n{n_samples}-seed{seed}.h5"),
                            n_samples, (size, size), seed)
    return model, FieldsDataset(path), F.mse_loss
