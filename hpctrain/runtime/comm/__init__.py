"""Communicators: one interface (``Communicator``) over MPI, torch.distributed, and MPI staged
through host memory for device tensors (``StagedCommunicator``).

Parallel strategies speak only :class:`Communicator`. The backends are imported on first
use, so importing the interface does not initialise MPI or torch.distributed.
"""

from .base import OPS, SUPPORTED_DTYPES, Communicator
from .null import NullCommunicator
from .requests import CollectiveRequest, CompletedRequest, Request, wait_all
from . import recording

recording.install()  # every backend's public ops are recorded alike

__all__ = ["OPS", "SUPPORTED_DTYPES", "CollectiveRequest", "Communicator", "CompletedRequest",
           "MPICommunicator", "NullCommunicator", "Request", "StagedCommunicator",
           "TorchDistCommunicator", "wait_all", "world"]

_LAZY = {"MPICommunicator": "mpi", "world": "mpi", "TorchDistCommunicator": "torchdist",
         "StagedCommunicator": "staged"}


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
