"""Activations and their gradients between stages, over the mesh's ``pp`` Communicator.

The shape and dtype crossing each stage boundary are agreed ONCE, by a small header sent
ahead of the first activation; later micro-batches move only the data, and a sender whose
output shape changes raises a clear error instead of corrupting the receiver.

Two issue orders (p2p_plan.py says which messages each action posts):

* eager (CPU: MPI, gloo): sends are non-blocking and never wait for the neighbour; receives
  block, and the time spent in them is the stage's idle time. Messages of one boundary and
  direction carry their own tag, so their order is the schedule's order.
* ordered (GPU: NCCL, or ``pipeline.p2p = ordered``): NCCL has no tags and its sends block
  until the receive runs, so every exchange is one group posted and completed together,
  all with tag 0 (matching by order alone); on MPI the sends are synchronous (Issend), so a
  CPU run behaves as NCCL would and proves the order safe.
"""

from __future__ import annotations

import os
import time

import torch

from hpctrain.parallel.pipeline.p2p_plan import Msg
from hpctrain.runtime.comm.idle import wait_idle

__all__ = ["StageLinks", "ShapeError", "WAITS", "P2P_MODES"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.int8, torch.bool)
_HEADER = 10  # dtype index, ndim, up to 8 dims
_KIND_TAG = {"act": 0, "grad": 1, "hdr": 2}

#: pipeline.p2p: "auto" is ordered on GPUs (NCCL) and eager on CPUs.
P2P_MODES = ("auto", "eager", "ordered")


class ShapeError(RuntimeError):
    """A tensor crossing a stage boundary changed shape or dtype after the first micro-batch."""


# How a blocked receive waits. "spin": the backend's blocking recv (Open MPI busy-polls a
# core). "yield": poll with sched_yield in between (gives the core to another runnable
# process, spins otherwise). "sleep": poll with naps of 10-50 us (runtime.comm.idle): never
# competes with a computing stage for a core, costs a nap of latency per message at most.
WAITS = ("spin", "yield", "sleep")


def ordered_mode(p2p: str, device: torch.device, p: int) -> bool:
    """Whether a pipeline of ``p`` ranks on ``device`` uses the ordered issue order."""
    if p2p not in P2P_MODES:
        raise ValueError(f"pipeline.p2p = {p2p!r}: expected one of {', '.join(P2P_MODES)}")
    if p == 1:
        return False  # every message stays on this rank
    return device.type == "cuda" if p2p == "auto" else p2p == "ordered"


class StageLinks:
    """Point-to-point links of one rank's stages. Boundary b joins stage b to stage b+1;
    stage g lives on pp rank g % p."""

    def __init__(self, comm, num_stages: int, device: torch.device, ordered: bool = False):
        self.comm = comm
        self.p = comm.size
        self.S = num_stages
        self.device = device
        self.ordered = ordered
        self.meta: dict[int, tuple] = {}   # boundary -> (shape, dtype), agreed once
        self._pending: list = []           # (request, tensor kept alive until sent)
        self._local: dict[Msg, torch.Tensor] = {}  # messages to this same rank
        self.recv_wait = 0.0               # seconds blocked in receives (idle time)
        # How a receive waits (WAITS). On a GPU the backend's recv only orders the streams
        # and the host must not block on the kernel, so only CPU ranks sleep-poll.
        self.wait = "sleep" if device.type == "cpu" else "spin"

    def _peer(self, msg: Msg, sending: bool) -> int:
        return (msg.dst_stage() if sending else msg.src_stage()) % self.p

    def _tag(self, msg: Msg) -> int:
        return self._tag_of(msg.kind, msg.boundary)

    def _tag_of(self, kind: str, boundary: int) -> int:
        return 0 if self.ordered else 3 * boundary + _KIND_TAG[kind]

    def _complete(self, req) -> None:
        """Wait for ``req`` the way this rank waits (WAITS), counting the time as idle."""
        t0 = time.perf_counter()
        if self.wait == "spin":
            req.wait()
        elif self.wait == "yield":
            while not req.test():
                os.sched_yield()
        else:
            wait_idle(req)
        self.recv_wait += time.perf_counter() - t0

    def _outgoing(self, sends) -> list:
        """(tensor, dest, tag) ops of ``sends`` [(Msg, tensor)], a shape header ahead of a
        boundary's first activation; messages to this rank are kept locally instead."""
        ops = []
        for msg, t in sends:
            t = t.detach().contiguous()
            if msg.kind == "act":
                header = self._check_shape(msg, t)
                if header is not None:
                    ops.append((header, self._peer(msg, True), self._tag_of("hdr", msg.boundary)))
            dest = self._peer(msg, True)
            if dest == self.comm.rank:
                self._local[msg] = t.clone()
            else:
                ops.append((t, dest, self._tag(msg)))
        return ops

    def _check_shape(self, msg: Msg, t: torch.Tensor):
        """The header to send ahead of boundary ``msg.boundary``'s first activation (None
        later); raise ShapeError when a later activation's shape or dtype differs."""
        b, shape, dtype = msg.boundary, tuple(t.shape), t.dtype
        if b in self.meta:
            if self.meta[b] != (shape, dtype):
                want = self.meta[b]
                raise ShapeError(
                    f"pipeline: stage {b} output for micro-batch {msg.mb} has shape {shape} "
                    f"{dtype}, but the stages agreed {want[0]} {want[1]} at the first "
                    f"micro-batch; pipeline micro-batches must keep one shape (make "
                    f"global_batch_size divisible by dp x pipeline.microbatches x grad_accum, "
                    f"keep sequence lengths fixed)")
            return None
        if t.dim() > _HEADER - 2 or dtype not in _DTYPES:
            raise TypeError(f"pipeline: stage {b} output of shape {shape} and dtype {dtype} "
                            f"cannot cross a stage boundary (at most {_HEADER - 2} dims, "
                            f"dtype one of {_DTYPES})")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0], header[1] = _DTYPES.index(dtype), len(shape)
        header[2:2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
        self.meta[b] = (shape, dtype)
        return header

    def _buffer(self, msg: Msg) -> torch.Tensor:
        shape, dtype = self.meta[msg.boundary]
        return torch.empty(shape, dtype=dtype, device=self.device)

    def post(self, sends=(), recvs=()) -> dict:
        """Send ``sends`` [(Msg, tensor)] and receive ``recvs`` [Msg]; return {Msg: tensor}.

        Eager: the sends are posted non-blocking (completed by ``wait_all``) and each
        receive blocks. Ordered: the sends and receives are one group, completed before
        this returns; a boundary's first activation needs its header first (to size the
        buffer), so that receive takes a group of its own after the headers'."""
        ops = self._outgoing(sends)
        got, remote = {}, []
        for msg in recvs:
            src = self._peer(msg, False)
            if src != self.comm.rank:
                remote.append((msg, src))
                continue
            if msg not in self._local:
                raise RuntimeError(f"pipeline: {msg} has not been produced on this rank yet; "
                                   "the schedule is out of order")
            got[msg] = self._local.pop(msg)
        new = [(m, s) for m, s in remote if m.kind == "act" and m.boundary not in self.meta]
        if not self.ordered:
            for op in ops:
                self._isend(*op)
            for msg, src in remote:
                if (msg, src) in new:
                    self._read_header(msg, self._recv(self._header_buffer(), src,
                                                      self._tag_of("hdr", msg.boundary)))
                got[msg] = self._recv(self._buffer(msg), src, self._tag(msg))
            return got
        if new:
            heads = [(self._header_buffer(), s, self._tag_of("hdr", m.boundary))
                     for m, s in new]
            self._complete(self.comm.p2p_group(ops, heads, synchronous=True))
            for (m, _), (h, _, _) in zip(new, heads):
                self._read_header(m, h)
            ops = []
        bufs = [(self._buffer(m), s, self._tag(m)) for m, s in remote]
        if ops or bufs:
            self._complete(self.comm.p2p_group(ops, bufs, synchronous=True))
        got.update((m, b) for (m, _), (b, _, _) in zip(remote, bufs))
        return got

    def _header_buffer(self) -> torch.Tensor:
        return torch.empty(_HEADER, dtype=torch.int64, device=self.device)

    def _read_header(self, msg: Msg, header: torch.Tensor) -> None:
        h = header.tolist()
        self.meta[msg.boundary] = (tuple(int(x) for x in h[2:2 + h[1]]), _DTYPES[h[0]])

    def _isend(self, tensor, dest, tag) -> None:
        self._pending.append((self.comm.isend(tensor, dest, tag), tensor))
        if len(self._pending) > 64:
            self._pending = [(r, t) for r, t in self._pending if not r.test()]

    def _recv(self, out: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        if self.wait == "spin":
            t0 = time.perf_counter()
            self.comm.recv(out, src, tag)
            self.recv_wait += time.perf_counter() - t0
        else:
            self._complete(self.comm.irecv(out, src, tag))
        return out

    def wait_all(self) -> None:
        """Complete every pending send (end of a step)."""
        for req, _ in self._pending:  # the last sends complete while neighbours compute
            req.wait() if self.wait == "spin" else wait_idle(req)
        self._pending.clear()
        if self._local:
            raise RuntimeError(f"pipeline: {sorted(map(str, self._local))} were sent on this "
                               "rank but never received; the schedule is incomplete")
