"""A one-rank communicator: the shard group of a rank that shards over nobody (NO_SHARD)."""

from __future__ import annotations

import torch

from hpctrain.runtime.comm import Communicator

__all__ = ["SoloCommunicator"]


class SoloCommunicator(Communicator):
    """This rank alone, on ``device``: every collective is the base class's size-1 fast path
    (no communication), so the backend hooks are never reached."""

    rank = 0
    size = 1

    def __init__(self, device: torch.device, backend: str = "solo"):
        self.device = torch.device(device)
        self.backend = backend

    def _unreachable(self, *args, **kwargs):
        raise RuntimeError("SoloCommunicator has one rank: there is no peer to talk to")

    _allreduce = _allgather = _reduce_scatter = _broadcast = _alltoall = _unreachable
    _barrier = _send = _recv = _isend = _irecv = _split = _unreachable

    def _free(self) -> None:
        """Nothing to release."""
