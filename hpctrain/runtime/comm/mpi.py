"""MPI backend: CPU tensors handed to mpi4py as zero-copy numpy views.

Only the uppercase (buffer) mpi4py calls are used on tensor paths: no pickling, no copies,
except the float32 temporaries that half-precision reductions need (see ``_allreduce``).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from .base import Communicator
from .null import NullCommunicator
from .requests import CollectiveRequest, Request

__all__ = ["MPICommunicator", "MPIRequest", "MPIRequests", "world"]

_MPI_TYPES = {
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
    torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.bool: MPI.C_BOOL,
}
# No portable MPI datatype exists for these: move them as raw bytes, reduce them in float32.
_HALF_TYPES = (torch.float16, torch.bfloat16)

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# In-place `a op= b` for the ring reduce-scatter.
_COMBINE = {
    "sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "prod": torch.Tensor.mul_,
    "max": lambda a, b: torch.maximum(a, b, out=a), "min": lambda a, b: torch.minimum(a, b, out=a),
}
# Derived datatypes move raw bytes: any type of the element's size will do for p2p.
_BY_ITEMSIZE = {1: MPI.BYTE, 2: MPI.INT16_T, 4: MPI.INT32_T, 8: MPI.INT64_T}
_BOX_TYPES_KEPT = 512  # committed message layouts cached per communicator (halo plans reuse them)
_RING_BYTES = 256 * 1024  # smaller reductions: MPI's own algorithm (latency-bound anyway)
_RING_TAG = 30_001        # p2p tag of the ring steps (pipeline/domain use small tags)
_PAIRWISE_TAG = 30_002    # p2p tag of the non-blocking pairwise reduce-scatter


def _as_buffer(tensor: torch.Tensor) -> list:
    """Return ``[numpy view, MPI datatype]`` sharing memory with a contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.dtype in _HALF_TYPES:
        return [tensor.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]
    return [tensor.numpy(), _MPI_TYPES[tensor.dtype]]


class MPIRequest(Request):
    """A pending mpi4py request; it holds the buffer so it cannot be freed before wait()."""

    def __init__(self, request: MPI.Request, buffer: list):
        self._request = request
        self._buffer = buffer

    def wait(self) -> None:
        """Block until the operation completes."""
        self._request.Wait()
        self._buffer = None

    def test(self) -> bool:
        """Return True if the operation has completed, without blocking."""
        done = self._request.Test()
        if done:
            self._buffer = None
        return done


class MPIRequests(Request):
    """Several mpi4py requests completed together (one Waitall/Testall); ``keep`` holds
    what they read or write (buffers, tensors) until then."""

    def __init__(self, requests: list, keep):
        self._requests, self._keep, self._done = requests, keep, False

    def wait(self) -> None:
        """Block until every operation completes."""
        if not self._done:
            MPI.Request.Waitall(self._requests)
            self._done, self._keep = True, None

    def test(self) -> bool:
        """Return True if every operation has completed, without blocking."""
        if not self._done and MPI.Request.Testall(self._requests):
            self._done, self._keep = True, None
        return self._done


class MPICommunicator(Communicator):
    """Communicator over an mpi4py intracommunicator; tensors must live on the CPU."""

    backend = "mpi"
    device = torch.device("cpu")

    def __init__(self, comm: MPI.Intracomm, *, owned: bool = False):
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"MPICommunicator needs an mpi4py intracommunicator, got {comm!r}; "
                            "ranks outside a group use NullCommunicator instead")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._owned = owned  # only communicators we created (split) are ours to Free

    def _allreduce(self, tensor, op):
        if tensor.dtype in _HALF_TYPES:
            # MPI cannot add float16/bfloat16: reduce a float32 copy, average there (so a
            # sum that overflows float16 still gives a finite mean), then cast back.
            tmp = tensor.float()
            self._allreduce(tmp, op)
            tensor.copy_(tmp)
            return
        self.comm.Allreduce(MPI.IN_PLACE, _as_buffer(tensor), op=_MPI_OPS[op])
        if op == "avg":
            tensor.div_(self.size)

    def _allgather(self, tensor, out):
        self.comm.Allgather(_as_buffer(tensor), _as_buffer(out))

    def _reduce_scatter(self, tensor, out, op):
        if tensor.dtype in _HALF_TYPES:  # float32 round trip, as in _allreduce
            tmp = torch.empty(out.shape, dtype=torch.float32)
            self._reduce_scatter(tensor.float(), tmp, op)
            out.copy_(tmp)
            return
        if tensor.numel() * tensor.element_size() >= _RING_BYTES and tensor.is_floating_point():
            self._ring_reduce_scatter(tensor.reshape(self.size, -1), out.view(-1), op)
        else:
            self.comm.Reduce_scatter_block(_as_buffer(tensor), _as_buffer(out), op=_MPI_OPS[op])
        if op == "avg":
            out.div_(self.size)

    # Non-blocking collectives: MPI-3's Iallreduce / Iallgather / Ireduce_scatter_block. The
    # MPIRequest holds the numpy views, the CollectiveRequest the tensors and staging
    # buffers, until complete; float16/bfloat16 reductions stage a float32 copy as above and
    # copy back on completion.

    def _iallreduce(self, tensor, op):
        if tensor.dtype in _HALF_TYPES:
            tmp = tensor.float()
            return CollectiveRequest(self._iallreduce(tmp, op), finish=lambda: tensor.copy_(tmp),
                                     keep=(tensor, tmp))
        buf = _as_buffer(tensor)
        req = MPIRequest(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=_MPI_OPS[op]), buf)
        return CollectiveRequest(req, finish=self._divider(tensor, op), keep=tensor)

    def _iallgather(self, tensor, out):
        bufs = (_as_buffer(tensor), _as_buffer(out))  # half types move as raw bytes
        return MPIRequest(self.comm.Iallgather(*bufs), (bufs, tensor, out))

    def _ireduce_scatter(self, tensor, out, op):
        """Large floating reductions: a pairwise exchange (``_pairwise_ireduce_scatter``);
        others: MPI's Ireduce_scatter_block. No ring as in the blocking call (a ring of
        non-blocking steps would need a progress engine of its own)."""
        if tensor.dtype in _HALF_TYPES:
            tmp_in, tmp_out = tensor.float(), torch.empty(out.shape, dtype=torch.float32)
            return CollectiveRequest(self._ireduce_scatter(tmp_in, tmp_out, op),
                                     finish=lambda: out.copy_(tmp_out), keep=(tmp_in, tmp_out))
        if tensor.numel() * tensor.element_size() >= _RING_BYTES and tensor.is_floating_point():
            return self._pairwise_ireduce_scatter(tensor.reshape(self.size, -1), out.view(-1), op)
        bufs = (_as_buffer(tensor), _as_buffer(out))
        req = MPIRequest(self.comm.Ireduce_scatter_block(*bufs, op=_MPI_OPS[op]), bufs)
        return CollectiveRequest(req, finish=self._divider(out, op), keep=(tensor, out))

    def _pairwise_ireduce_scatter(self, chunks: torch.Tensor, out: torch.Tensor, op: str):
        """Non-blocking reduce-scatter as one round of point-to-point messages: rank j's
        chunk goes to rank j from every other rank, all posted at once (no step waits for
        another, so MPI's ordinary progress completes it), and completion combines the
        received chunks with this rank's own in rank order. Bandwidth as the ring's (each
        rank sends (p-1)/p of the tensor); p-1 chunk-sized receive buffers. Open MPI's
        Ireduce_scatter_block took twice the ring's time per MB at 2 ranks (``bench step``
        pieces), this takes less. Started in the same order on every rank, as every
        collective: the messages of concurrent calls pair up in that order (MPI does not
        let messages between two ranks with one tag overtake each other)."""
        p, r = self.size, self.rank
        recv = torch.empty((p - 1, chunks.shape[1]), dtype=chunks.dtype)
        peers = [j for j in range(p) if j != r]
        bufs = [_as_buffer(recv[k]) for k in range(p - 1)]
        bufs += [_as_buffer(chunks[j]) for j in peers]
        reqs = [self.comm.Irecv(bufs[k], source=j, tag=_PAIRWISE_TAG)
                for k, j in enumerate(peers)]
        reqs += [self.comm.Isend(bufs[p - 1 + k], dest=j, tag=_PAIRWISE_TAG)
                 for k, j in enumerate(peers)]
        combine = _COMBINE[op]

        def finish():
            parts = list(recv.unbind(0))
            parts.insert(r, chunks[r])
            out.copy_(parts[0])
            for t in parts[1:]:
                combine(out, t)
            if op == "avg":
                out.div_(p)
        return CollectiveRequest(MPIRequests(reqs, bufs), finish=finish,
                                 keep=(chunks, out, recv))

    def _divider(self, tensor, op):
        """What completes an average: the division of the sum by the size (None otherwise)."""
        return (lambda: tensor.div_(self.size)) if op == "avg" else None

    def _ring_reduce_scatter(self, chunks: torch.Tensor, out: torch.Tensor, op: str) -> None:
        """Ring reduce-scatter: p-1 Sendrecv steps of one chunk each, two chunk-sized
        temporaries. Open MPI's Reduce_scatter_block may reduce the whole vector on one rank
        first (a full-size temporary there), which is what ZeRO's memory budget cannot afford."""
        p, r = self.size, self.rank
        right, left = (r + 1) % p, (r - 1) % p
        acc = chunks[(r - 1) % p].clone()
        tmp = torch.empty_like(acc)
        combine = _COMBINE[op]
        for s in range(p - 1):
            recv = out if s == p - 2 else tmp  # the last step lands in out: one temporary less
            self.comm.Sendrecv(_as_buffer(acc), dest=right, sendtag=_RING_TAG,
                               recvbuf=_as_buffer(recv), source=left, recvtag=_RING_TAG)
            combine(recv, chunks[(r - s - 2) % p])
            if recv is tmp:
                acc, tmp = tmp, acc

    def _broadcast(self, tensor, root):
        self.comm.Bcast(_as_buffer(tensor), root=root)

    def _alltoall(self, tensor, out):
        self.comm.Alltoall(_as_buffer(tensor), _as_buffer(out))

    def _barrier(self):
        self.comm.Barrier()

    def _send(self, tensor, dest, tag):
        self.comm.Send(_as_buffer(tensor), dest=dest, tag=tag)

    def _recv(self, tensor, source, tag):
        self.comm.Recv(_as_buffer(tensor), source=source, tag=tag)

    def _isend(self, tensor, dest, tag):
        buf = _as_buffer(tensor)
        return MPIRequest(self.comm.Isend(buf, dest=dest, tag=tag), buf)

    def _irecv(self, tensor, source, tag):
        buf = _as_buffer(tensor)
        return MPIRequest(self.comm.Irecv(buf, source=source, tag=tag), buf)

    def _p2p_group(self, sends, recvs, synchronous):
        """One request over all the ops (Waitall/Testall); Issend when ``synchronous``."""
        bufs = [_as_buffer(t) for t, _, _ in recvs] + [_as_buffer(t) for t, _, _ in sends]
        post = self.comm.Issend if synchronous else self.comm.Isend
        reqs = [self.comm.Irecv(b, source=s, tag=tag) for b, (_, s, tag) in zip(bufs, recvs)]
        reqs += [post(b, dest=d, tag=tag) for b, (_, d, tag) in zip(bufs[len(recvs):], sends)]
        return MPIRequests(reqs, bufs)

    def _isend_boxes(self, tensor, boxes, dest, tag):
        buf = self._boxes_message(tensor, boxes)
        return MPIRequest(self.comm.Isend(buf, dest=dest, tag=tag), (buf, tensor))

    def _irecv_boxes(self, tensor, boxes, source, tag):
        buf = self._boxes_message(tensor, boxes)
        return MPIRequest(self.comm.Irecv(buf, source=source, tag=tag), (buf, tensor))

    def _boxes_message(self, tensor, boxes) -> list:
        """``[buffer, 1, datatype]`` describing the boxes in place (no packing).

        The datatype (a struct of nested hvectors, one per box) depends only on the
        tensor's shape, strides and element size and on the boxes, so it is built and
        committed once per layout: a halo plan sends the same layout every step.
        """
        key = (tuple(tensor.shape), tensor.stride(), tensor.element_size(), tuple(boxes))
        cache = self.__dict__.setdefault("_box_types", {})
        dtype = cache.get(key)
        if dtype is None:
            if len(cache) >= _BOX_TYPES_KEPT:  # forget the oldest layout
                cache.pop(next(iter(cache))).Free()
            dtype = cache[key] = _boxes_type(*key)
        nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
        return [MPI.buffer.fromaddress(tensor.data_ptr(), nbytes), 1, dtype]

    def _boxes_exchange(self, recvs, sends):
        from hpctrain.runtime.comm.mpi_exchange import MPIBoxesExchange

        return MPIBoxesExchange(self, recvs, sends)

    def _split(self, color, key):
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return NullCommunicator(self.backend)
        return MPICommunicator(sub, owned=True)

    def world_ranks(self):
        ranks = self.__dict__.get("_world_ranks")
        if ranks is None:  # local: translate through the groups, once
            world = MPI.COMM_WORLD.Get_group()
            ranks = self._world_ranks = list(self.comm.Get_group().Translate_ranks(
                list(range(self.comm.Get_size())), world))
        return ranks

    def _free(self):
        if self._owned and self.comm != MPI.COMM_NULL:
            self.comm.Free()  # sets self.comm to COMM_NULL, so a second free() is harmless


def world() -> MPICommunicator:
    """Return a communicator over MPI.COMM_WORLD (all ranks of the job)."""
    return MPICommunicator(MPI.COMM_WORLD)


def _strided_type(shape, strides, itemsize: int) -> MPI.Datatype:
    """An (uncommitted) datatype for one strided view: contiguous runs, then hvectors."""
    runs = []  # (count, stride in elements), innermost first, with mergeable dims merged
    for n, st in reversed([(n, st) for n, st in zip(shape, strides) if n != 1]):
        if runs and st == runs[-1][0] * runs[-1][1]:
            runs[-1] = (runs[-1][0] * n, runs[-1][1])
        else:
            runs.append((n, st))
    elem = _BY_ITEMSIZE[itemsize]
    if not runs:
        return elem.Dup()
    n, st = runs[0]
    dtype = elem.Create_contiguous(n) if st == 1 else elem.Create_hvector(n, 1, st * itemsize)
    for n, st in runs[1:]:
        outer = dtype.Create_hvector(n, 1, st * itemsize)
        dtype.Free()  # the outer type keeps what it needs (MPI standard, 5.1.10)
        dtype = outer
    return dtype


def _boxes_type(shape, stride, itemsize: int, boxes) -> MPI.Datatype:
    """Committed struct of the boxes (trailing-dim (start, stop) ranges) of a strided tensor."""
    parts, offsets = [], []
    for box in boxes:
        lead = len(shape) - len(box)
        sizes = tuple(shape[:lead]) + tuple(hi - lo for lo, hi in box)
        offsets.append(sum(lo * st for (lo, _), st in zip(box, stride[lead:])) * itemsize)
        parts.append(_strided_type(sizes, stride, itemsize) if all(sizes) else
                     _BY_ITEMSIZE[itemsize].Create_contiguous(0))
    dtype = MPI.Datatype.Create_struct([1] * len(parts), offsets, parts)
    dtype.Commit()
    for p in parts:
        p.Free()
    return dtype
