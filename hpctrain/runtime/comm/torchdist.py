"""torch.distributed backend: "nccl" on GPUs, "gloo" on CPUs, one code path for both.

MPI launches the ranks and stays alongside as a side channel: rank 0 of the MPI communicator
picks the TCP rendezvous address and broadcasts it, and ``split`` exchanges colors over MPI
so every member builds the same torch process group.
"""

from __future__ import annotations

import datetime
import inspect
import socket

import torch
import torch.distributed as dist

from .base import Communicator
from .null import NullCommunicator
from .requests import AllRequests, CollectiveRequest, Request
from .markers import stream_marker as _stream_marker
from .mpi import MPICommunicator

__all__ = ["TorchDistCommunicator", "TorchDistRequest"]

_BACKENDS = ("nccl", "gloo")
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}

# Single-tensor collectives; the newer names first (the older ones warn as deprecated).
_ALLGATHER = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None)
_HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters
_UNSUPPORTED = object()  # what _try_native returns when the backend lacks the collective
# At least this for every group made from now on (extend_op_timeout)
_MIN_TIMEOUT = datetime.timedelta(0)


# Subgroups by their global ranks in group-rank order. They are created with
# use_local_synchronization, whose group names are hashes of the ranks, so one rank list
# cannot be created twice: later splits that give the same ranks reuse the group.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


class TorchDistRequest(Request):
    """A pending torch.distributed work handle; it holds the tensor until wait().

    Gloo's send/recv handles report is_completed() False until wait() has been called (it
    is what finishes them), so polling them would never end: for those (``pollable=False``)
    test() waits, which keeps every polling loop correct, only not idle.
    """

    def __init__(self, work, tensor: torch.Tensor, pollable: bool = True):
        self._work = work
        self._tensor = tensor
        self._pollable = pollable
        self._done = False

    def wait(self) -> None:
        """Block until the operation completes."""
        if not self._done:  # a second wait on a finished gloo handle would block
            self._work.wait()
            self._done = True
        self._tensor = None

    def test(self) -> bool:
        """Return True if the operation has completed, without blocking."""
        if not self._pollable:
            self.wait()
            return True
        done = self._done or self._work.is_completed()
        if done:
            self._tensor = None
        return done


class TorchDistCommunicator(Communicator):
    """Communicator over a torch.distributed process group; build it with :meth:`create`."""

    def __init__(self, mpi: MPICommunicator, backend: str, device: torch.device,
                 ranks: list[int], group, timeout: datetime.timedelta, owns_world: bool):
        self._mpi = mpi            # same ranks, same order: carries the split metadata
        self.backend = backend
        self.device = device
        self.rank = mpi.rank
        self.size = mpi.size
        self.group = group         # None means the default (world) group
        self._ranks = ranks        # global rank of each rank of this communicator
        self._timeout = timeout
        self._owns_world = owns_world
        self._native_collectives = True  # False once the backend lacks the tensor forms
        if backend == "nccl":  # a call only queues the kernel: flight entries end on the GPU
            self._device_marker = _stream_marker

    @classmethod
    def create(cls, mpi_comm, backend: str = "nccl", timeout_s: float = 600
               ) -> TorchDistCommunicator:
        """Initialise torch.distributed over the ranks of ``mpi_comm``; collective over them.

        Rank 0 picks a free TCP port and broadcasts ``host:port`` over MPI. An already
        initialised default group is reused (it must span the same ranks). For "nccl",
        call ``torch.cuda.set_device(local_rank)`` first: the current device is used.
        """
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}; "
                             "use 'nccl' on GPUs and 'gloo' on CPUs")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs a CUDA GPU but none is visible; "
                               "use backend='gloo' on CPU-only nodes")
        mpi = mpi_comm if isinstance(mpi_comm, MPICommunicator) else MPICommunicator(mpi_comm)
        timeout = datetime.timedelta(seconds=timeout_s)
        owns_world = not dist.is_initialized()
        if owns_world:
            address = _bcast_address(mpi)
            dist.init_process_group(backend, init_method=f"tcp://{address}", rank=mpi.rank,
                                    world_size=mpi.size, timeout=timeout)
        else:
            _check_reusable(mpi, backend)
        device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                  else torch.device("cpu"))
        return cls(mpi, backend, device, list(range(mpi.size)), None, timeout, owns_world)

    def _allreduce(self, tensor, op):
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group)
        if op == "avg":  # sum then divide: ReduceOp.AVG is NCCL-only on older torch
            tensor.div_(self.size)

    def _allgather(self, tensor, out):
        if self._try_native(_ALLGATHER, out, tensor) is _UNSUPPORTED:
            # The list holds views of out, so the gathered chunks land in place.
            dist.all_gather(list(out.chunk(self.size)), tensor, group=self.group)

    def _reduce_scatter(self, tensor, out, op):
        if self._try_native(_REDUCE_SCATTER, out, tensor, op=_REDUCE_OPS[op]) is _UNSUPPORTED:
            total = tensor.clone()
            dist.all_reduce(total, op=_REDUCE_OPS[op], group=self.group)
            out.copy_(total.chunk(self.size)[self.rank])
        if op == "avg":
            out.div_(self.size)

    # Non-blocking collectives: the calls above with async_op=True, which nccl and gloo take
    # for every one of them (the list-based fallbacks too), so nothing here falls back to a
    # blocking call. The request divides an average (and copies an all-reduced chunk out)
    # once the work is complete.

    def _iallreduce(self, tensor, op):
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group, async_op=True)
        return CollectiveRequest(TorchDistRequest(work, tensor),
                                 finish=_divider(tensor, op, self.size))

    def _iallgather(self, tensor, out):
        work = self._try_native(_ALLGATHER, out, tensor, async_op=True)
        if work is _UNSUPPORTED:
            work = dist.all_gather(list(out.chunk(self.size)), tensor, group=self.group,
                                   async_op=True)
        return TorchDistRequest(work, (tensor, out))

    def _ireduce_scatter(self, tensor, out, op):
        """Gloo's reduce_scatter handle is not pollable: it fills ``out`` only inside wait()
        and never reports is_completed() before (torch 2.x), so test() could never see it
        finish. There (and where the tensor form is missing) all-reduce a copy in the
        background and copy this rank's chunk out on completion: a full-size temporary in
        host memory."""
        avg = _divider(out, op, self.size)
        work = _UNSUPPORTED if self.backend == "gloo" else self._try_native(
            _REDUCE_SCATTER, out, tensor, op=_REDUCE_OPS[op], async_op=True)
        if work is not _UNSUPPORTED:
            return CollectiveRequest(TorchDistRequest(work, (tensor, out)), finish=avg)
        total = tensor.clone()
        work = dist.all_reduce(total, op=_REDUCE_OPS[op], group=self.group, async_op=True)

        def finish():
            out.copy_(total.chunk(self.size)[self.rank])
            if avg is not None:
                avg()
        return CollectiveRequest(TorchDistRequest(work, total), finish=finish, keep=(tensor, out))

    def _broadcast(self, tensor, root):
        dist.broadcast(tensor, src=self._ranks[root], group=self.group)

    def _alltoall(self, tensor, out):
        dist.all_to_all_single(out, tensor, group=self.group)

    def _barrier(self):
        # NCCL otherwise guesses the device from the global rank and warns.
        ids = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        dist.barrier(group=self.group, **ids)

    def _send(self, tensor, dest, tag):
        dist.send(tensor, dst=self._ranks[dest], group=self.group, tag=tag)

    def _recv(self, tensor, source, tag):
        dist.recv(tensor, src=self._ranks[source], group=self.group, tag=tag)

    def _isend(self, tensor, dest, tag):
        work = dist.isend(tensor, dst=self._ranks[dest], group=self.group, tag=tag)
        return TorchDistRequest(work, tensor, pollable=self.backend != "gloo")

    def _irecv(self, tensor, source, tag):
        work = dist.irecv(tensor, src=self._ranks[source], group=self.group, tag=tag)
        return TorchDistRequest(work, tensor, pollable=self.backend != "gloo")

    def _p2p_group(self, sends, recvs, synchronous):
        """NCCL: one batch_isend_irecv (an ncclGroup, so the ops cannot block each other);
        gloo never blocks a send on its receive, so its ops go one by one."""
        if self.backend != "nccl":
            return super()._p2p_group(sends, recvs, synchronous)
        ops = [dist.P2POp(dist.irecv, t, self._ranks[s], self.group, tag) for t, s, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, self._ranks[d], self.group, tag) for t, d, tag in sends]
        works = dist.batch_isend_irecv(ops)  # one work per op, or one for the whole batch
        keep = [op.tensor for op in ops]
        return AllRequests([TorchDistRequest(w, keep) for w in works])

    def _split(self, color, key):
        # new_group needs the same rank list on every member: share (color, key, global rank).
        # Small bootstrap metadata, so mpi4py's pickling allgather is fine here.
        entries = self._mpi.comm.allgather((color, key, self._ranks[self.rank]))
        sub_mpi = self._mpi.split(color, key)
        if color is None:
            return NullCommunicator(self.backend)
        # MPI_Comm_split's order: by key, ties broken by parent rank.
        order = sorted(range(len(entries)), key=lambda i: (entries[i][1], i))
        ranks = [entries[i][2] for i in order if entries[i][0] == color]
        sub = TorchDistCommunicator(sub_mpi, self.backend, self.device, ranks,
                                    self._group(ranks), self._timeout, owns_world=False)
        sub._native_collectives = self._native_collectives
        return sub

    def world_ranks(self):
        return list(self._ranks)  # torch.distributed global ranks are the MPI world's

    def extend_op_timeout(self, seconds: float) -> None:
        """torch's own watchdog (NCCL's, gloo's) tears the process down when an op exceeds
        the group's timeout; give every group of this process at least ``seconds``, now and
        when created later, so hpctrain's stall report comes first."""
        global _MIN_TIMEOUT
        want = datetime.timedelta(seconds=seconds)
        if want <= max(self._timeout, _MIN_TIMEOUT):
            return
        _MIN_TIMEOUT = self._timeout = want
        if dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(want)  # the default group
            for group in _GROUPS.values():
                dist.distributed_c10d._set_pg_timeout(want, group)

    def _free(self):
        self._mpi.free()  # frees only MPI comms made by split, never the one given to create
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()  # destroys the subgroups too
            _GROUPS.clear()
        self._owns_world = False

    def _group(self, ranks: list[int]):
        """Return the process group of ``ranks`` (in that rank order), creating it if new."""
        if ranks == list(range(dist.get_world_size())):
            return None
        key = tuple(ranks)
        if key not in _GROUPS:
            extra = {}
            if ranks != sorted(ranks):
                if not _HAS_SORT_RANKS:
                    raise NotImplementedError(
                        "split with keys that reorder ranks needs torch.distributed.new_group"
                        "(sort_ranks=False), which this torch lacks; upgrade torch or pass "
                        "keys in parent-rank order")
                extra["sort_ranks"] = False
            # Local synchronisation: only members call new_group, so splitting a subgroup
            # does not need the ranks outside it (which are not in this collective).
            _GROUPS[key] = dist.new_group(ranks, timeout=max(self._timeout, _MIN_TIMEOUT),
                                          use_local_synchronization=True, **extra)
        return _GROUPS[key]

    def _try_native(self, collective, *args, **kwargs):
        """Run a single-tensor collective and return what it returns (its work handle with
        async_op=True); return _UNSUPPORTED if the backend does not have it."""
        if collective is None or not self._native_collectives:
            return _UNSUPPORTED
        try:
            return collective(*args, group=self.group, **kwargs)
        except (RuntimeError, NotImplementedError) as err:
            # Backends reject an unsupported collective locally, before any communication,
            # and every rank does the same, so falling back here cannot desynchronise ranks.
            if "support" not in str(err).lower() and "implement" not in str(err).lower():
                raise
            self._native_collectives = False
            return _UNSUPPORTED


def _divider(tensor, op: str, size: int):
    """What completes an average: the division of the sum by ``size`` (None otherwise);
    sum then divide, as ReduceOp.AVG is NCCL-only on older torch."""
    return (lambda: tensor.div_(size)) if op == "avg" else None


def _bcast_address(mpi: MPICommunicator) -> str:
    """Pick ``host:port`` on rank 0 and broadcast it over MPI; collective over ``mpi``."""
    address = error = None
    if mpi.rank == 0:
        try:
            host = socket.gethostname()
            with socket.socket() as sock:
                sock.bind((host, 0))  # port 0: the OS picks a free port
                address = f"{host}:{sock.getsockname()[1]}"
        except OSError as err:
            error = f"rank 0 could not pick a rendezvous port on {socket.gethostname()}: {err}"
    # Broadcast the failure too, so the other ranks raise instead of hanging.
    address, error = mpi.comm.bcast((address, error), root=0)
    if error:
        raise RuntimeError(error)
    return address


def _check_reusable(mpi: MPICommunicator, backend: str) -> None:
    """Raise unless the initialised default group matches ``mpi`` and ``backend``."""
    if dist.get_world_size() != mpi.size or dist.get_rank() != mpi.rank:
        raise RuntimeError(
            f"torch.distributed is already initialised with world size "
            f"{dist.get_world_size()} (rank {dist.get_rank()}), which does not match the MPI "
            f"communicator (size {mpi.size}, rank {mpi.rank}); create the communicator from "
            "the MPI communicator the default group was made for")
    if backend not in str(dist.get_backend()):
        raise ValueError(f"torch.distributed is already initialised with backend "
                         f"{dist.get_backend()!r}, not {backend!r}; ask for that backend")

