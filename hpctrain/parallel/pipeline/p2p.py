"""Activations and their gradients between stages, over the mesh's ``pp`` Communicator.

The shape and dtype crossing each stage boundary are agreed ONCE, by a small header sent
ahead of the first activation; later micro-batches move only the data, and a sender whose
output shape changes raises a clear error instead of corrupting the receiver. Sends are
non-blocking (a stage never waits for its neighbour to be ready); receives block, and the
time spent in them is the stage's idle time. Messages of one boundary and direction carry
their own tag, so their order is the schedule's order (MPI never overtakes on one tag).
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

from hpctrain.runtime.comm.idle import wait_idle

__all__ = ["StageLinks", "ShapeError", "WAITS"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.int8, torch.bool)
_HEADER = 10  # dtype index, ndim, up to 8 dims


class ShapeError(RuntimeError):
    """A tensor crossing a stage boundary changed shape or dtype after the first micro-batch."""


# How a blocked receive waits. "spin": the backend's blocking recv (Open MPI busy-polls a
# core). "yield": poll with sched_yield in between (gives the core to another runnable
# process, spins otherwise). "sleep": poll with naps of 10-50 us (runtime.comm.idle): never
# competes with a computing stage for a core, costs a nap of latency per message at most.
WAITS = ("spin", "yield", "sleep")


class StageLinks:
    """Point-to-point links of one rank's stages. Boundary b joins stage b to stage b+1;
    stage g lives on pp rank g % p."""

    def __init__(self, comm, num_stages: int, device: torch.device):
        self.comm = comm
        self.p = comm.size
        self.S = num_stages
        self.device = device
        self.meta: dict[int, tuple] = {}   # boundary -> (shape, dtype), agreed once
        self._pending: list = []           # (request, tensor kept alive until sent)
        self._local: dict[int, deque] = {} # tag -> messages to this same rank
        self.recv_wait = 0.0               # seconds blocked in receives (idle time)
        # How a receive waits (WAITS). On a GPU the backend's recv only orders the streams
        # and the host must not block on the kernel, so only CPU ranks sleep-poll.
        self.wait = "sleep" if device.type == "cpu" else "spin"

    # tags: activations 3b, gradients 3b+1, headers 3b+2
    def _rank(self, stage: int) -> int:
        return stage % self.p

    def _send(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        dest = self._rank(stage)
        if dest == self.comm.rank:
            self._local.setdefault(tag, deque()).append(tensor.clone())
            return
        self._pending.append((self.comm.isend(tensor, dest, tag), tensor))
        if len(self._pending) > 64:
            self._pending = [(r, t) for r, t in self._pending if not r.test()]

    def _recv(self, out: torch.Tensor, stage: int, tag: int) -> torch.Tensor:
        src = self._rank(stage)
        if src == self.comm.rank:
            q = self._local.get(tag)
            if not q:
                raise RuntimeError(f"pipeline: stage {stage} has not produced message tag {tag} "
                                   "yet; the schedule is out of order")
            return q.popleft()
        t0 = time.perf_counter()
        if self.wait == "spin":
            self.comm.recv(out, src, tag)
        else:
            req = self.comm.irecv(out, src, tag)
            if self.wait == "yield":
                while not req.test():
                    os.sched_yield()
            else:
                wait_idle(req)
        self.recv_wait += time.perf_counter() - t0
        return out

    def send_activation(self, b: int, t: torch.Tensor, mb: int) -> None:
        """Send stage b's output (boundary b) to stage b+1."""
        t = t.detach().contiguous()
        shape, dtype = tuple(t.shape), t.dtype
        if b not in self.meta:
            if t.dim() > _HEADER - 2 or dtype not in _DTYPES:
                raise TypeError(f"pipeline: stage {b} output of shape {shape} and dtype {dtype} "
                                f"cannot cross a stage boundary (at most {_HEADER - 2} dims, "
                                f"dtype one of {_DTYPES})")
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(dtype), len(shape)
            header[2:2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
            self._send(header, b + 1, 3 * b + 2)
            self.meta[b] = (shape, dtype)
        elif self.meta[b] != (shape, dtype):
            want = self.meta[b]
            raise ShapeError(
                f"pipeline: stage {b} output for micro-batch {mb} has shape {shape} {dtype}, but "
                f"the stages agreed {want[0]} {want[1]} at the first micro-batch; pipeline "
                f"micro-batches must keep one shape (make global_batch_size divisible by "
                f"dp x pipeline.microbatches x grad_accum, keep sequence lengths fixed)")
        self._send(t, b + 1, 3 * b)

    def recv_activation(self, b: int) -> torch.Tensor:
        """Receive stage b's output (boundary b) on stage b+1."""
        if b not in self.meta:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            header = self._recv(header, b, 3 * b + 2).tolist()
            self.meta[b] = (tuple(int(x) for x in header[2:2 + header[1]]), _DTYPES[header[0]])
        shape, dtype = self.meta[b]
        return self._recv(torch.empty(shape, dtype=dtype, device=self.device), b, 3 * b)

    def send_grad(self, b: int, g: torch.Tensor) -> None:
        """Send the gradient of boundary b's activation back from stage b+1 to stage b."""
        self._send(g.detach().contiguous(), b, 3 * b + 1)

    def recv_grad(self, b: int) -> torch.Tensor:
        """Receive the gradient of boundary b's activation on stage b."""
        shape, dtype = self.meta[b]
        return self._recv(torch.empty(shape, dtype=dtype, device=self.device), b + 1, 3 * b + 1)

    def wait_all(self) -> None:
        """Complete every pending send (end of a step)."""
        for req, _ in self._pending:  # the last sends complete while neighbours compute
            req.wait() if self.wait == "spin" else wait_idle(req)
        self._pending.clear()
