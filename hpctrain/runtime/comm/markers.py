"""The flight recorder's device marker for NCCL ops, apart from torchdist (whose import starts
MPI) so a one-process check can use the very marker the communicator uses."""

from __future__ import annotations

import torch

__all__ = ["stream_marker"]


def stream_marker():
    """A CUDA event recorded on the current stream, behind the op just issued or waited
    for (ProcessGroupNCCL makes the current stream wait for its NCCL stream): it completes
    when the op has completed on the GPU. The flight recorder's marker for NCCL ops."""
    event = torch.cuda.Event()
    event.record()
    return event
