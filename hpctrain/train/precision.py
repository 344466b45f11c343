"""Mixed precision: autocast context and, for fp16, a gradient scaler."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Precision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """fp32: plain; bf16: autocast (no scaling needed); fp16: autocast + dynamic loss scaling.

    Parameters and optimizer state stay fp32; only the forward math runs in low precision.
    """

    def __init__(self, name: str, device: torch.device):
        if name not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision {name!r}: expected fp32, bf16 or fp16")
        self.name = name
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self):
        """Context manager for the forward pass and the loss."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.name])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale the loss before backward (fp16 only)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss
