"""Gradient reduce-scatter of a flat unit, piece by piece: blocking, or overlapped with backward.

A unit's gradients are never packed into one unit-sized buffer: each rank's next elements
are copied into a piece of at most ``_PIECE_BYTES`` and at most the reduce bucket (all ranks'
parts together) and that is reduce-scattered into the shard gradient, so the transient is
bounded by the piece, not by the unit: a bucket smaller than a unit splits it.

``InFlight`` is the overlapped form (Horovod's pattern: start in the hooks, complete in the
synchronize): ``start`` packs a unit's pieces into buffers of their own and starts them as
non-blocking ``ireduce_scatter``; the piece buffers alive at once (in flight or kept for
reuse) are capped by the reduce bucket (``reduce_bucket_size``, default ``_INFLIGHT_BYTES``:
a piece that would pass the cap first completes the oldest ones); the all-reduces over a
unit's replicas and partial groups start when its pieces are complete; ``finish_all``
completes everything, in start order. What starts next depends only on the order of
``start`` calls and byte counts, never on which request happens to be done, so ranks that
make the same calls issue the same collectives in the same order.
"""

from __future__ import annotations

from collections import deque

import torch

from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.unit_policy import DEFAULT_BUCKET_BYTES
from hpctrain.runtime.comm.idle import wait_idle

__all__ = ["InFlight", "reduce_scatter_grads", "reduction_buffer_bytes", "DEFAULT_BUCKET_BYTES"]

# Gradient bytes packed for one reduce-scatter (all ranks' pieces together): bounds the
# transient next to a unit's gradients; bigger pieces only save a few collective calls...
_PIECE_BYTES = 1 << 20
# ...but each rank's part of a piece stays at least this big, or many ranks would turn a
# unit into many latency-bound collectives (the buffer is then N x this, at most the unit).
_MIN_RANK_PIECE_BYTES = 1 << 18
# Piece bytes in flight (started, not yet completed) in the overlapped reduction: a piece
# that would pass this first completes the oldest ones (at least one piece is always let
# through). It bounds the transient next to the gradients (the completed pieces' buffers,
# kept for reuse, stay within it too; a backend may stage up to as much again to receive,
# as the MPI backend's pairwise exchange does); more in flight only lets a reduction lag
# further behind backward.
# The default: the reduce bucket's (``reduce_bucket_size`` of [zero] / [fsdp], bytes).
_INFLIGHT_BYTES = DEFAULT_BUCKET_BYTES


def reduction_buffer_bytes(bucket: int, n: int) -> int:
    """The most bytes the overlapped reduction over ``n`` ranks holds besides the gradients
    and their shards, for a reduce bucket of ``bucket`` bytes: the pieces in flight (at most
    the bucket), their buffers kept for reuse (within the bucket too: one bucket in all), and
    what the backend stages to receive while they fly, (n-1)/n of each piece in flight (the
    MPI backend's pairwise exchange). One rank alone reduces nothing. A bucket smaller than
    one element per rank still lets one piece through (up to 8-byte elements)."""
    if n <= 1:
        return 0
    bucket = max(bucket, 8 * n)
    return bucket + bucket * (n - 1) // n


class _Reduction:
    """One unit's gradient reduction in flight."""

    def __init__(self, unit: FlatUnit, comm, stages: list):
        self.unit = unit
        self.comm = comm        # the shard group
        self.part = None        # the shard gradient the pieces reduce into
        self.left = 0           # its pieces not yet completed
        self.launched = False   # every piece is started (left == 0 then means all done)
        self.stages = stages    # all-reduces over replicas / partial groups still to start
        self.req = None         # the stage all-reduce in flight


class InFlight:
    """The reductions started in this step (see the module docstring).

    ``bucket``: the most bytes of piece buffers alive at once, in flight or kept for reuse
    (``reduce_bucket_size``; one piece is always let through, so a bucket smaller than one
    element per rank still reduces). Measured: ``peak_bytes``, the most piece-buffer bytes
    alive at once, and ``peak_inflight``, the most piece bytes in flight at once (what the
    backend stages to receive follows it, ``reduction_buffer_bytes``)."""

    def __init__(self, reduce_dtype: torch.dtype | None = None, bucket: int | None = None):
        self.reduce_dtype = reduce_dtype
        self.bucket = bucket if bucket is not None else _INFLIGHT_BYTES
        self.jobs: list[_Reduction] = []  # started this step, in start order
        self.inflight: deque = deque()    # (reduction, request, bytes, buffer) in flight
        self.spare: list = []             # piece buffers of completed pieces, for reuse
        self.inflight_bytes = 0
        self.held = 0                     # bytes of piece buffers alive (in flight + spare)
        self.peak_bytes = 0
        self.peak_inflight = 0

    def start(self, unit: FlatUnit, comm, stages: list) -> None:
        """Start reducing the unit's gradients (SUM) into a new shard gradient: non-blocking
        reduce-scatters over the shard group ``comm``, then all-reduces over ``stages``
        (replicas, partial groups). The full gradients are freed. Collective;
        ``finish_all`` completes it and adds it to the unit's shard gradient."""
        job = _Reduction(unit, comm, list(stages))
        self.jobs.append(job)
        self._start_pieces(job)
        if job.left == 0:
            self._next_stage(job)

    def progress(self) -> None:
        """Let MPI move data (it has no progress thread): test the oldest request in flight.
        That only lets a completed one free its buffers early: what starts next never
        depends on it."""
        if self.inflight:
            self.inflight[0][1].test()
            return
        for job in self.jobs:  # no pieces in flight: the oldest unfinished all-reduce
            if job.req is not None and not job.req.test():
                return

    def finish_all(self) -> None:
        """Complete every started reduction, in start order, into the shard gradients."""
        for job in self.jobs:
            self._finish(job)
        self.jobs = []

    def _start_pieces(self, job: _Reduction) -> None:
        """The pieces of ``reduce_scatter_grads``, each packed into a buffer of its own."""
        u, comm, n = job.unit, job.comm, job.comm.size
        size = u.shard_numel
        grads = [None if s.param.grad is None else s.param.grad.reshape(-1) for s in u.slots]
        part = job.part = torch.empty(size, dtype=self.reduce_dtype or u.full.dtype,
                                      device=u.full.device)
        if n == 1:  # one rank per shard group: the shard is the whole buffer
            u.grad_range(0, size, part, grads)
        else:
            esize = part.element_size()
            step = _piece_elems(size, n, esize, self.bucket)
            for a in range(0, size, step):
                b = min(a + step, size)
                nb = n * (b - a) * esize
                buf = self._piece_buffer(n * (b - a), part)
                _pack(u, grads, a, b, buf.view(n, b - a))
                self._launch(job, comm.ireduce_scatter(buf, out=part[a:b], op="sum"), nb, buf)
        del grads
        for s in u.slots:
            s.param.grad = None
        job.launched = True

    def _launch(self, job: _Reduction, req, nbytes: int, buf) -> None:
        """Track a started reduce-scatter piece: its bytes in flight and its buffer (reused
        once ``_complete_oldest`` completed it)."""
        job.left += 1
        self.inflight.append((job, req, nbytes, buf))
        self.inflight_bytes += nbytes
        self.peak_inflight = max(self.peak_inflight, self.inflight_bytes)

    def _wait(self, job: _Reduction, req) -> None:
        """Complete req. On CPU ranks poll with naps (``wait_idle``) instead of MPI's busy
        wait: the rank it waits for computes on the same cores (ranks >= cores), and a
        spinning waiter slows that rank down."""
        if job.comm.device.type == "cpu":
            wait_idle(req)
        req.wait()

    def _piece_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer for one piece: a completed piece's when one fits (a fresh multi-MB
        tensor page-faults on first touch, every step), else a new one once the buffers
        alive leave room for it under the bucket: spare buffers that do not fit are dropped
        first, then the oldest pieces in flight are completed (their buffers become spare).
        Which pieces complete depends only on the sizes started, the same on every rank."""
        nbytes = numel * like.element_size()
        while True:
            for k, buf in enumerate(self.spare):
                if buf.dtype == like.dtype and buf.device == like.device and buf.numel() >= numel:
                    return self.spare.pop(k)[:numel]
            if self.held + nbytes <= self.bucket or not (self.inflight or self.spare):
                self.held += nbytes
                self.peak_bytes = max(self.peak_bytes, self.held)
                return torch.empty(numel, dtype=like.dtype, device=like.device)
            if self.spare:  # none fits: give the smallest back
                k = min(range(len(self.spare)), key=lambda j: self.spare[j].numel())
                dropped = self.spare.pop(k)
                self.held -= dropped.numel() * dropped.element_size()
            else:
                self._complete_oldest()

    def _complete_oldest(self) -> None:
        job, req, nb, buf = self.inflight.popleft()
        self._wait(job, req)
        base = buf if buf._base is None else buf._base
        self.spare.append(base)  # kept for the next pieces (and steps): counted in held
        self.inflight_bytes -= nb
        job.left -= 1
        # Its shard gradient is reduced over the shard group once every piece is started
        # and complete: a small bucket completes a unit's first pieces while it still
        # starts its last ones, and the next stage must not read the gradient before them.
        if job.left == 0 and job.launched:
            self._next_stage(job)

    def _next_stage(self, job: _Reduction) -> None:
        """Start the unit's next all-reduce over replicas / partial groups (it needs the
        previous one complete: wait for it here)."""
        if job.req is not None:
            self._wait(job, job.req)
            job.req = None
        if job.stages:
            job.req = job.stages.pop(0).iallreduce(job.part, op="sum")

    def _finish(self, job: _Reduction) -> None:
        """Complete a started reduction and add it to the unit's shard gradient."""
        while job.left:
            self._complete_oldest()  # pieces complete in start order: the job's come up
        while job.req is not None or job.stages:
            self._next_stage(job)
        u, part = job.unit, job.part
        if part.dtype != u.shard.dtype or part.device != u.shard.device:
            part = part.to(u.shard.device, u.shard.dtype)  # fp32 master / host shard
        u.add_shard_grad(part)


def reduce_scatter_grads(u: FlatUnit, comm, dtype: torch.dtype | None = None,
                         bucket: int | None = None):
    """Reduce-scatter (SUM over ``comm``) the gradients of a unit's params into a new shard
    gradient, and free the params' .grad; returns (shard gradient, transient buffer bytes).
    Blocking; ``InFlight.start`` starts the same pieces non-blocking.

    The gradients are never packed into one unit-sized buffer: piece by piece, each rank's
    next elements are copied into a buffer of at most _PIECE_BYTES and that is
    reduce-scattered into the shard gradient, so the transient is bounded by the piece, not
    by the unit (a unit-sized buffer next to the unit's gradients was 2 units)."""
    n, size = comm.size, u.shard_numel
    dtype, device = dtype or u.full.dtype, u.full.device
    grads = [None if s.param.grad is None else s.param.grad.reshape(-1) for s in u.slots]
    part = torch.empty(size, dtype=dtype, device=device)
    transient = 0
    if n == 1:  # one rank per shard group: the shard is the whole buffer
        u.grad_range(0, size, part, grads)
    else:
        esize = part.element_size()
        step = _piece_elems(size, n, esize, bucket if bucket is not None else _INFLIGHT_BYTES)
        buf = torch.empty(n * step, dtype=dtype, device=device)
        transient = buf.numel() * esize
        for a in range(0, size, step):
            b = min(a + step, size)
            piece = buf[:n * (b - a)].view(n, b - a)
            _pack(u, grads, a, b, piece)
            comm.reduce_scatter(piece.view(-1), out=part[a:b], op="sum")
        del buf
    del grads
    for s in u.slots:
        s.param.grad = None
    return part, transient


def _piece_elems(size: int, n: int, esize: int, bucket: int) -> int:
    """Elements of each rank's shard per reduce-scatter piece (see _PIECE_BYTES), all ranks'
    parts together within ``bucket`` bytes (at least one element per rank)."""
    per_rank = min(max(_PIECE_BYTES // n, _MIN_RANK_PIECE_BYTES), bucket // n)
    return min(size, max(1, per_rank // esize))


def _pack(u: FlatUnit, grads: list, a: int, b: int, piece: torch.Tensor) -> None:
    """Row r of piece (n, b - a): elements [a, b) of rank r's shard of the unit's flat
    gradient (grads[j]: slot j's flat gradient or None)."""
    size = u.shard_numel
    for r in range(piece.shape[0]):
        u.grad_range(r * size + a, r * size + b, piece[r], grads)


