"""MPI for device tensors, staged through host memory: the GPU communicator when NCCL cannot run.

NCCL takes one rank per GPU; ranks that share a GPU (or a GPU job without NCCL) still need a
device communicator. This one wraps an :class:`MPICommunicator`: every hook copies its device
tensors into host buffers, runs the MPI hook on them, and copies the results back (on
completion, for non-blocking ops). Before MPI reads a host buffer the current stream is
synchronised, so a value the GPU is still computing is never sent.

Slower than NCCL (two copies over PCIe per op), but exact: MPI reduces the same host values
the CPU backend does, in the same order.
"""

from __future__ import annotations

import torch

from .base import Communicator, box_index
from .null import NullCommunicator
from .requests import CollectiveRequest, UnpackRequest
from .mpi import MPICommunicator

__all__ = ["StagedCommunicator"]


class StagedCommunicator(Communicator):
    """Communicator for tensors on ``device`` over ``inner`` (an MPICommunicator over the same
    ranks), staged through host memory; see the module docstring.

    ``force_staging``: copy through separate host buffers even when ``device`` is the CPU
    (tests exercise the copies and the box logic there); a CPU device without it hands the
    tensors to MPI as they are.
    """

    backend = "mpi-staged"

    def __init__(self, inner: MPICommunicator, device, *, force_staging: bool = False):
        if not isinstance(inner, MPICommunicator):
            raise TypeError(f"StagedCommunicator wraps an MPICommunicator, got {inner!r}")
        self._inner = inner
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors name their index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank, self.size = inner.rank, inner.size
        self._force = force_staging
        self._copies = force_staging or self.device.type != "cpu"
        # Pinned buffers: the device copies run at full speed and asynchronously; the caching
        # host allocator keeps a buffer from reuse until the copies queued on it have run.
        self._pin = self.device.type == "cuda"
        self._cuda = self.device.type == "cuda"

    # ---- staging -----------------------------------------------------------------------

    def _empty(self, tensor: torch.Tensor, shape=None) -> torch.Tensor:
        """A host buffer for ``tensor``'s values (or of ``shape``); the tensor itself when no
        copy is needed."""
        if not self._copies:
            return tensor if shape is None else torch.empty(shape, dtype=tensor.dtype)
        return torch.empty(tensor.shape if shape is None else shape, dtype=tensor.dtype,
                           device="cpu", pin_memory=self._pin)

    def _to_host(self, *tensors: torch.Tensor) -> list:
        """Host copies of ``tensors``, complete (the stream synchronised) when this returns."""
        if not self._copies:
            return list(tensors)
        hosts = []
        for t in tensors:
            h = self._empty(t)
            h.copy_(t, non_blocking=self._cuda)
            hosts.append(h)
        self._sync()
        return hosts

    def _sync(self) -> None:
        """Wait for the current stream: the queued device->host copies (and the kernels that
        wrote their sources) have run, so MPI reads final values."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _back(self, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a host result into the device tensor (queued on the current stream)."""
        if host is not tensor:
            tensor.copy_(host, non_blocking=self._cuda)

    def _later(self, request, pairs, keep=()):
        """``request``, copying each (device, host) pair back once it completes."""
        pairs = [(t, h) for t, h in pairs if t is not h]

        def finish():
            for t, h in pairs:
                self._back(t, h)
        return CollectiveRequest(request, finish=finish if pairs else None, keep=(pairs, keep))

    # ---- collectives -------------------------------------------------------------------

    def _allreduce(self, tensor, op):
        (h,) = self._to_host(tensor)
        self._inner._allreduce(h, op)
        self._back(tensor, h)

    def _allgather(self, tensor, out):
        (h,) = self._to_host(tensor)
        h_out = self._empty(out)
        self._inner._allgather(h, h_out)
        self._back(out, h_out)

    def _reduce_scatter(self, tensor, out, op):
        (h,) = self._to_host(tensor)
        h_out = self._empty(out)
        self._inner._reduce_scatter(h, h_out, op)
        self._back(out, h_out)

    def _iallreduce(self, tensor, op):
        (h,) = self._to_host(tensor)
        return self._later(self._inner._iallreduce(h, op), [(tensor, h)])

    def _iallgather(self, tensor, out):
        (h,) = self._to_host(tensor)
        h_out = self._empty(out)
        return self._later(self._inner._iallgather(h, h_out), [(out, h_out)], keep=h)

    def _ireduce_scatter(self, tensor, out, op):
        (h,) = self._to_host(tensor)
        h_out = self._empty(out)
        return self._later(self._inner._ireduce_scatter(h, h_out, op), [(out, h_out)], keep=h)

    def _broadcast(self, tensor, root):
        # Only the root's values travel: the others need just a buffer to receive into.
        h = self._to_host(tensor)[0] if self.rank == root else self._empty(tensor)
        self._inner._broadcast(h, root)
        if self.rank != root:
            self._back(tensor, h)

    def _alltoall(self, tensor, out):
        (h,) = self._to_host(tensor)
        h_out = self._empty(out)
        self._inner._alltoall(h, h_out)
        self._back(out, h_out)

    def _barrier(self):
        self._inner._barrier()

    # ---- point to point ----------------------------------------------------------------

    def _send(self, tensor, dest, tag):
        (h,) = self._to_host(tensor)
        self._inner._send(h, dest, tag)

    def _recv(self, tensor, source, tag):
        h = self._empty(tensor)
        self._inner._recv(h, source, tag)
        self._back(tensor, h)

    def _isend(self, tensor, dest, tag):
        (h,) = self._to_host(tensor)
        return self._later(self._inner._isend(h, dest, tag), [], keep=h)

    def _irecv(self, tensor, source, tag):
        h = self._empty(tensor)
        return self._later(self._inner._irecv(h, source, tag), [(tensor, h)])

    def _p2p_group(self, sends, recvs, synchronous):
        """One MPI group over host buffers: every send staged (one synchronisation), every
        receive copied back once the whole group has completed."""
        h_sends = self._to_host(*[t for t, _, _ in sends])
        h_recvs = [self._empty(t) for t, _, _ in recvs]
        req = self._inner._p2p_group([(h, d, tag) for h, (_, d, tag) in zip(h_sends, sends)],
                                     [(h, s, tag) for h, (_, s, tag) in zip(h_recvs, recvs)],
                                     synchronous)
        return self._later(req, [(t, h) for h, (t, _, _) in zip(h_recvs, recvs)], keep=h_sends)

    # _isend_boxes: the base class's packing (torch.cat of the boxes on the device, then the
    # staged _isend) moves only the boxes across the bus.

    def _irecv_boxes(self, tensor, boxes, source, tag):
        """Receive into one host buffer and copy back ONLY the boxes: other messages may be
        filling other boxes of the same tensor at the same time."""
        views = [tensor[box_index(b)] for b in boxes]
        h = self._empty(tensor, (sum(v.numel() for v in views),))
        return UnpackRequest(self._inner._irecv(h, source, tag), h, views)

    # ---- management --------------------------------------------------------------------

    def _split(self, color, key):
        sub = self._inner._split(color, key)
        if not isinstance(sub, MPICommunicator):
            return NullCommunicator(self.backend)
        return StagedCommunicator(sub, self.device, force_staging=self._force)

    def world_ranks(self):
        return self._inner.world_ranks()

    def _free(self):
        self._inner._free()  # frees only MPI comms made by split (MPICommunicator's rule)
