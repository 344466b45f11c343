"""The backend-neutral communicator interface that parallel strategies speak.

``Communicator`` holds the input checks, the size-1 fast paths and the bool handling once;
a backend implements only the ``_``-prefixed hooks, which receive tensors that are already
validated, detached and contiguous, and an ``out`` of the right shape. The handles the
non-blocking calls return are in ``requests.py``; the flight recorder's wrappers around the
public operations are put on the class by ``recording.py`` when the
``hpctrain.runtime.comm`` package is imported.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from hpctrain.runtime.comm.exchange import BoxesExchange
from hpctrain.runtime.comm.requests import (AllRequests, CollectiveRequest, CompletedRequest,
                                            Request, UnpackRequest)

__all__ = ["OPS", "BLOCKING_OPS", "BLOCKING_FORM", "NONBLOCKING_OPS", "SUPPORTED_DTYPES",
           "Communicator", "box_index"]

#: The Communicator's operations (the flight recorder wraps each one): blocking ones end
#: when the call returns, non-blocking ones when their request completes.
BLOCKING_OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier",
                "allreduce_scalars", "send", "recv", "split")
NONBLOCKING_OPS = ("iallreduce", "iallgather", "ireduce_scatter", "isend", "irecv",
                   "p2p_group", "isend_boxes", "irecv_boxes")
#: The blocking operation each non-blocking one starts ("iallreduce" -> "allreduce"): what a
#: record of either moves, counted or replayed alike.
BLOCKING_FORM = {op: op[1:] for op in NONBLOCKING_OPS if op[1:] in BLOCKING_OPS}

#: Reduction op names accepted by ``allreduce``, ``reduce_scatter`` and ``allreduce_scalars``.
OPS = ("sum", "avg", "max", "min", "prod")

#: Tensor dtypes every backend moves and reduces.
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool)

# Bool tensors are reduced as their uint8 bytes (0/1): max is logical or, min is logical and.
_BOOL_OPS = ("max", "min")


class Communicator(ABC):
    """A group of ranks that can communicate tensors; see the module docstring.

    Collectives (``allreduce`` ... ``barrier`` and their non-blocking ``i`` forms) must be
    called by every rank of the communicator, in the same order.

    Non-blocking collectives: ``iallreduce``, ``iallgather`` and ``ireduce_scatter`` check
    their arguments as the blocking calls do, start the collective and return a
    :class:`CollectiveRequest` ``req`` (a :class:`CompletedRequest` on a size-1 communicator,
    after a local copy); either way the result is ``req.out`` (the input tensor itself for
    ``iallreduce``), valid only after ``req.wait()`` (which returns it) or once ``req.test()``
    returned True. Rules, as for MPI's non-blocking collectives:

    * every rank starts them in the same order (also relative to blocking collectives on
      this communicator); they may be completed in any order;
    * neither the input nor ``out`` may be read or written until the request completes,
      and every request must be completed (wait, or test until True);
    * on a CPU the MPI library moves data only inside MPI calls (Open MPI has no progress
      thread by default), so a long computation between start and wait overlaps little
      unless it calls ``req.test()`` now and then.
    """

    backend: str
    rank: int
    size: int
    device: torch.device
    is_active: bool = True
    #: Group name in flight records and stall reports ('world', 'dp', ...); set by who splits.
    name: str = "comm"
    #: None, or (NCCL) a zero-argument callable returning a marker with ``.query() -> bool``: a
    #: completed op's flight entry then ends when the device reaches the marker
    #: (rec.end_on_device; see recording.py)
    _device_marker = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, "
                f"size={self.size})")

    # ---- collectives -------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place and return it; collective over all ranks."""
        self._check_tensor(tensor, "tensor")
        self._check_op(op, tensor.dtype)
        if self.size > 1:
            self._allreduce(_wire(tensor), op)
        return tensor

    def allgather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0; collective over all ranks."""
        out = self._gather_out(tensor, out, "allgather")
        if self.size == 1:
            return out.copy_(tensor)
        self._allgather(_wire(tensor), _wire(out))
        return out

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor | None = None,
                       op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` and return this rank's dim-0 chunk of it; collective over all ranks."""
        out = self._scatter_out(tensor, out, op, "reduce_scatter")
        if self.size == 1:
            return out.copy_(tensor)
        self._reduce_scatter(_wire(tensor), _wire(out), op)
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` in place with the root's copy; collective over all ranks."""
        self._check_tensor(tensor, "tensor")
        self._check_rank(root, "root")
        if self.size > 1:
            self._broadcast(_wire(tensor), root)
        return tensor

    def alltoall(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Send dim-0 chunk i to rank i, receive chunks in rank order; collective over all ranks."""
        self._check_tensor(tensor, "tensor")
        self._check_divisible(tensor, "alltoall")
        out = self._out(out, tensor, tuple(tensor.shape), "alltoall")
        if self.size == 1:
            return out.copy_(tensor)
        self._alltoall(_wire(tensor), _wire(out))
        return out

    # ---- non-blocking collectives (see the class docstring) ----------------------------

    def iallreduce(self, tensor: torch.Tensor, op: str = "sum") -> Request:
        """Start reducing ``tensor`` in place; ``req.out`` is ``tensor``, reduced once the
        request completes. Non-blocking, collective over all ranks; checks as ``allreduce``."""
        self._check_tensor(tensor, "tensor")
        self._check_op(op, tensor.dtype)
        if self.size == 1:
            return CompletedRequest(tensor)
        return CollectiveRequest(self._iallreduce(_wire(tensor), op), tensor)

    def iallgather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Request:
        """Start concatenating every rank's ``tensor`` along dim 0 into ``req.out`` (``out``,
        or a new tensor when None). Non-blocking, collective over all ranks; checks as
        ``allgather``."""
        out = self._gather_out(tensor, out, "iallgather")
        if self.size == 1:
            return CompletedRequest(out.copy_(tensor))
        return CollectiveRequest(self._iallgather(_wire(tensor), _wire(out)), out)

    def ireduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor | None = None,
                        op: str = "sum") -> Request:
        """Start reducing ``tensor`` into this rank's dim-0 chunk, ``req.out`` (``out``, or a
        new tensor when None). Non-blocking, collective over all ranks; checks as
        ``reduce_scatter`` (dim 0 divisible by the size)."""
        out = self._scatter_out(tensor, out, op, "ireduce_scatter")
        if self.size == 1:
            return CompletedRequest(out.copy_(tensor))
        return CollectiveRequest(self._ireduce_scatter(_wire(tensor), _wire(out), op), out)

    def barrier(self) -> None:
        """Block until every rank has entered the barrier; collective over all ranks."""
        if self.size > 1:
            self._barrier()

    def allreduce_scalars(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Reduce a few host-side numbers in float64 and return them; collective over all ranks."""
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
                isinstance(v, numbers.Real) for v in values):
            raise TypeError(
                f"allreduce_scalars takes a sequence of real numbers, got {values!r}; "
                "convert tensors with float(t) or t.tolist() first")
        self._check_op(op, torch.float64)
        floats = [float(v) for v in values]
        if self.size == 1 or not floats:
            return floats
        buf = torch.tensor(floats, dtype=torch.float64, device=self.device)
        self._allreduce(buf, op)
        return buf.tolist()

    # ---- point to point ----------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Blocking send of ``tensor`` to rank ``dest`` in standard mode (point to point)."""
        self._check_p2p(tensor, dest, "dest", tag)
        self._send(_wire(tensor), dest, tag)

    def recv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        """Blocking receive from rank ``source`` into ``tensor`` and return it (point to point)."""
        self._check_p2p(tensor, source, "source", tag)
        self._recv(_wire(tensor), source, tag)
        return tensor

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        """Start a non-blocking send to ``dest`` (point to point); keep ``tensor`` until wait()."""
        self._check_p2p(tensor, dest, "dest", tag)
        return self._isend(_wire(tensor), dest, tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        """Start a non-blocking receive from ``source`` into ``tensor`` (point to point)."""
        self._check_p2p(tensor, source, "source", tag)
        return self._irecv(_wire(tensor), source, tag)

    def p2p_group(self, sends: Sequence = (), recvs: Sequence = (),
                  synchronous: bool = False) -> Request:
        """Post ``sends`` [(tensor, dest, tag)] and ``recvs`` [(tensor, source, tag)] as one
        group; the Request completes when all have. Ops in a group progress independently,
        so two ranks that each send to and receive from the other in one group cannot
        deadlock, whatever the order (NCCL: one ncclGroupStart/End, whose sends otherwise
        block until the peer's receive runs). ``synchronous``: a send completes only once
        its receive has started (MPI_Issend), as NCCL's do, so a CPU run can prove an issue
        order safe for NCCL; backends without that mode ignore it."""
        for tensor, peer, tag in sends:
            self._check_p2p(tensor, peer, "dest", tag)
        for tensor, peer, tag in recvs:
            self._check_p2p(tensor, peer, "source", tag)
        return self._p2p_group([(_wire(t), d, tag) for t, d, tag in sends],
                               [(_wire(t), s, tag) for t, s, tag in recvs], synchronous)

    def isend_boxes(self, tensor: torch.Tensor, boxes: Sequence, dest: int,
                    tag: int = 0) -> Request:
        """Send several boxes of ``tensor`` as ONE message to ``dest`` (point to point).

        A box is ``((start, stop), ...)`` over the trailing dims (leading dims whole); the
        receiver gets each box's elements row-major, box after box (``irecv_boxes`` with
        boxes of the same sizes). Keep ``tensor`` unchanged until wait(). Backends that can
        describe strided memory (MPI derived datatypes, cached per layout) send in place;
        others pack a copy.
        """
        self._check_boxes(tensor, boxes, dest, "dest", tag)
        return self._isend_boxes(tensor.detach(), boxes, dest, tag)

    def irecv_boxes(self, tensor: torch.Tensor, boxes: Sequence, source: int,
                    tag: int = 0) -> Request:
        """Receive ONE message from ``source`` into boxes of ``tensor`` (filled by wait())."""
        self._check_boxes(tensor, boxes, source, "source", tag)
        return self._irecv_boxes(tensor.detach(), boxes, source, tag)

    def boxes_exchange(self, recvs: Sequence, sends: Sequence):
        """Prepare an exchange that is started many times (a halo exchange): ``recvs`` and
        ``sends`` are ``(peer, tag, boxes)`` messages, checked here once; see
        ``exchange.BoxesExchange.start``. A local call: nothing is sent until start()."""
        return self._boxes_exchange(recvs, sends)

    # ---- management --------------------------------------------------------------------

    def split(self, color: int | None, key: int = 0, name: str | None = None) -> Communicator:
        """Split by ``color`` (None: a NullCommunicator), ranked by ``key``; collective over all.
        ``name`` names the new group in flight records (default: this one's + '.split')."""
        if color is not None and (not _is_int(color) or color < 0):
            raise ValueError(f"split color must be a non-negative int or None, got {color!r}; "
                             "use None for ranks that should not join any group")
        if not _is_int(key):
            raise TypeError(f"split key must be an int, got {key!r}")
        child = self._split(color, key)
        child.name = name or f"{self.name}.split"
        return child

    def world_ranks(self) -> list[int] | None:
        """The world rank of each member, in this communicator's rank order (None: unknown);
        flight records name a group instance by them."""
        return None

    def extend_op_timeout(self, seconds: float) -> None:
        """A backend that times ops out by itself (torch.distributed's watchdog) allows at
        least ``seconds``, so the stall watchdog reports first. MPI has no timeout: nothing."""

    def free(self) -> None:
        """Release this communicator's resources (a local call); do not use it afterwards."""
        self._free()

    # ---- backend hooks -----------------------------------------------------------------

    @abstractmethod
    def _allreduce(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce ``tensor`` in place over all ranks (size > 1, op valid for its dtype)."""

    @abstractmethod
    def _allgather(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Gather into ``out`` over all ranks."""

    @abstractmethod
    def _reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: str) -> None:
        """Reduce and scatter into ``out`` over all ranks."""

    # Non-blocking collective hooks: the returned request completes once the result is in
    # place (any copy back or division done). The defaults run the blocking hook and return a
    # CompletedRequest: correct for any backend, only not overlapped with computation.

    def _iallreduce(self, tensor: torch.Tensor, op: str) -> Request:
        """Start reducing ``tensor`` in place over all ranks (default: blocking)."""
        self._allreduce(tensor, op)
        return CompletedRequest()

    def _iallgather(self, tensor: torch.Tensor, out: torch.Tensor) -> Request:
        """Start gathering into ``out`` over all ranks (default: blocking)."""
        self._allgather(tensor, out)
        return CompletedRequest()

    def _ireduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor, op: str) -> Request:
        """Start reducing and scattering into ``out`` over all ranks (default: blocking)."""
        self._reduce_scatter(tensor, out, op)
        return CompletedRequest()

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Broadcast ``tensor`` in place from ``root`` over all ranks."""

    @abstractmethod
    def _alltoall(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Exchange equal dim-0 chunks into ``out`` over all ranks."""

    @abstractmethod
    def _barrier(self) -> None:
        """Synchronise all ranks."""

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dest: int, tag: int) -> None:
        """Blocking send to ``dest``."""

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, source: int, tag: int) -> None:
        """Blocking receive from ``source`` into ``tensor``."""

    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dest: int, tag: int) -> Request:
        """Start a non-blocking send to ``dest``."""

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, source: int, tag: int) -> Request:
        """Start a non-blocking receive from ``source``."""

    def _p2p_group(self, sends, recvs, synchronous: bool) -> Request:
        """Default: each op posted on its own, receives first (nothing here blocks)."""
        return AllRequests([self._irecv(t, s, tag) for t, s, tag in recvs]
                           + [self._isend(t, d, tag) for t, d, tag in sends])

    def _isend_boxes(self, tensor, boxes, dest: int, tag: int) -> Request:
        """Default: pack the boxes into one buffer and send it (the backend's request holds
        its buffer until complete, as MPIRequest and TorchDistRequest do)."""
        return self._isend(torch.cat([tensor[box_index(b)].reshape(-1) for b in boxes]), dest, tag)

    def _irecv_boxes(self, tensor, boxes, source: int, tag: int) -> Request:
        """Default: receive into one buffer and unpack it into the boxes on wait()."""
        views = [tensor[box_index(b)] for b in boxes]
        buf = torch.empty(sum(v.numel() for v in views), dtype=tensor.dtype, device=tensor.device)
        return UnpackRequest(self._irecv(buf, source, tag), buf, views)

    def _boxes_exchange(self, recvs, sends):
        return BoxesExchange(self, recvs, sends)

    @abstractmethod
    def _split(self, color: int | None, key: int) -> Communicator:
        """Split over all ranks (arguments already checked)."""

    @abstractmethod
    def _free(self) -> None:
        """Release backend resources."""

    # ---- input checks ------------------------------------------------------------------

    def _check_tensor(self, tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise TypeError(f"{what} has dtype {tensor.dtype}, which the communicator does not "
                            f"support; use one of: {names}")
        if tensor.device != self.device:
            raise ValueError(
                f"{what} is on {tensor.device} but the {self.backend!r} backend communicates "
                f"tensors on {self.device}; move it with {what}.to(comm.device) first")
        if not tensor.is_contiguous():
            raise ValueError(
                f"{what} is not contiguous (shape {tuple(tensor.shape)}, stride "
                f"{tuple(tensor.stride())}); communication needs one dense buffer: pass "
                f"{what}.contiguous() (and copy back if you need the result in place)")

    def _check_op(self, op, dtype: torch.dtype) -> None:
        if op not in OPS:
            raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(OPS)}")
        if dtype == torch.bool:
            if op not in _BOOL_OPS:
                raise ValueError(f"op={op!r} is not defined for bool tensors; use op='max' "
                                 "(logical or) or op='min' (logical and), or convert to int")
        elif op == "avg" and not dtype.is_floating_point:
            raise ValueError(f"op='avg' needs a floating-point tensor, got {dtype}; use "
                             "op='sum' and divide, or convert the tensor to float first")

    def _check_rank(self, rank, what: str) -> None:
        if not _is_int(rank):
            raise TypeError(f"{what} must be an int rank, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{what}={rank} is not a rank of this communicator; "
                             f"expected 0 <= {what} < size={self.size}")

    def _check_tag(self, tag) -> None:
        if not _is_int(tag) or tag < 0:
            raise ValueError(f"tag must be a non-negative int, got {tag!r}")

    def _check_p2p(self, tensor, peer, what: str, tag) -> None:
        self._check_tensor(tensor, "tensor")
        self._check_rank(peer, what)
        self._check_tag(tag)

    def _check_boxes(self, tensor, boxes, peer, what: str, tag) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES or tensor.device != self.device:
            self._check_tensor(tensor, "tensor")  # raises its clear dtype/device error
        # Halo plans send the same few layouts every step: check each layout once.
        seen = self.__dict__.setdefault("_boxes_checked", set())
        key = (tuple(tensor.shape), boxes, peer, tag)
        try:
            if key in seen:
                return
        except TypeError:  # unhashable boxes (lists): check every time
            key = None
        if not isinstance(boxes, Sequence) or not boxes:
            raise ValueError(f"boxes must be a non-empty list of boxes, got {boxes!r}")
        for box in boxes:
            if len(box) > tensor.dim() or any(
                    not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, tensor.shape[-len(box):])):
                raise ValueError(f"box {box!r} does not fit the trailing dims of a tensor of "
                                 f"shape {tuple(tensor.shape)}")
        self._check_rank(peer, what)
        self._check_tag(tag)
        if key is not None and len(seen) < 4096:
            seen.add(key)

    def _gather_out(self, tensor, out, name: str) -> torch.Tensor:
        """Check an allgather's arguments; return its (checked or new) ``out``."""
        self._check_tensor(tensor, "tensor")
        _check_has_dim0(tensor, name)
        shape = (tensor.shape[0] * self.size, *tensor.shape[1:])
        return self._out(out, tensor, shape, name)

    def _scatter_out(self, tensor, out, op, name: str) -> torch.Tensor:
        """Check a reduce_scatter's arguments; return its (checked or new) ``out``."""
        self._check_tensor(tensor, "tensor")
        self._check_op(op, tensor.dtype)
        self._check_divisible(tensor, name)
        shape = (tensor.shape[0] // self.size, *tensor.shape[1:])
        return self._out(out, tensor, shape, name)

    def _check_divisible(self, tensor: torch.Tensor, name: str) -> None:
        _check_has_dim0(tensor, name)
        if tensor.shape[0] % self.size:
            raise ValueError(
                f"{name} needs tensor.shape[0] divisible by the communicator size {self.size}, "
                f"got shape {tuple(tensor.shape)}; pad dim 0 to a multiple of {self.size}")

    def _out(self, out, tensor: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
        """Return ``out`` after checking it, or a new tensor of ``shape`` when it is None."""
        if out is None:
            return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        self._check_tensor(out, "out")
        if out.dtype != tensor.dtype:
            raise TypeError(f"{name}: out has dtype {out.dtype} but tensor has {tensor.dtype}; "
                            "they must match")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(
                f"{name}: out has shape {tuple(out.shape)} but a tensor of shape "
                f"{tuple(tensor.shape)} on {self.size} ranks needs {tuple(shape)}; "
                "pass out=None to allocate it")
        if _overlaps(out, tensor):
            raise ValueError(f"{name}: out overlaps the input tensor; pass a separate tensor "
                             "or out=None")
        return out


def box_index(box) -> tuple:
    """The index expression of a box ((start, stop) per trailing dim)."""
    return (Ellipsis,) + tuple(slice(lo, hi) for lo, hi in box)


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """Detach (communication is outside autograd) and view bools as their uint8 bytes."""
    tensor = tensor.detach()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_has_dim0(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{name} works along dim 0 but got a 0-d tensor; "
                         "pass tensor.reshape(1)")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
