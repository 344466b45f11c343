"""Tests for hpctrain.runtime.comm: real mpirun runs (both backends in one launch per world
size), input checks in-process."""

import numpy as np
import pytest
import torch

from hpctrain.runtime.comm import (CollectiveRequest, Communicator, CompletedRequest,
                                   NullCommunicator, Request, TorchDistCommunicator, wait_all)
from tests.mpirun import run_mpi

WORKER = "tests/runtime/comm_worker.py"


BACKENDS = ["mpi", "gloo"]


@pytest.fixture(scope="module")
def worker_runs():
    """{ranks: output}, filled by a world size's first case: comm_worker checks both backends
    in one launch per world size."""
    return {}


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_worker_all_ops(worker_runs, backend, nranks):
    if nranks not in worker_runs:
        worker_runs[nranks] = run_mpi(nranks, [WORKER, *BACKENDS], timeout=150).stdout
    assert f"comm_worker OK backend={backend} size={nranks}" in worker_runs[nranks]


@pytest.fixture
def comm():
    """A 1-rank MPI communicator: every check below fails before any communication."""
    from mpi4py import MPI

    from hpctrain.runtime.comm import MPICommunicator
    return MPICommunicator(MPI.COMM_SELF)


def wider(comm, size):
    """Pretend ``comm`` has ``size`` ranks, for checks that depend on the size only."""
    comm.size = size
    return comm


def test_is_a_communicator(comm):
    assert isinstance(comm, Communicator)
    assert (comm.backend, comm.rank, comm.size, comm.is_active) == ("mpi", 0, 1, True)
    assert comm.device == torch.device("cpu")


def test_size_one_fast_paths(comm):
    t = torch.arange(6.0).reshape(3, 2)
    assert comm.allreduce(t, op="avg") is t
    gathered = comm.allgather(t)
    assert torch.equal(gathered, t) and gathered.data_ptr() != t.data_ptr()
    assert torch.equal(comm.reduce_scatter(t), t)
    assert torch.equal(comm.alltoall(t), t)
    assert comm.broadcast(t) is t
    assert comm.allreduce_scalars([1, 2.5], op="max") == [1.0, 2.5]
    comm.barrier()


def test_size_one_nonblocking_fast_paths(comm):
    t = torch.arange(6.0).reshape(3, 2)
    req = comm.iallreduce(t, op="avg")
    assert isinstance(req, CompletedRequest) and req.test()
    assert req.out is t and req.wait() is t and torch.equal(t, torch.arange(6.0).reshape(3, 2))
    req = comm.iallgather(t)
    assert isinstance(req, CompletedRequest)
    assert torch.equal(req.wait(), t) and req.out.data_ptr() != t.data_ptr()
    out = torch.empty(3, 2)
    assert comm.ireduce_scatter(t, out=out).wait() is out and torch.equal(out, t)
    flags = torch.tensor([True, False])
    assert torch.equal(comm.iallgather(flags).wait(), flags)
    assert wait_all([comm.iallreduce(t), comm.iallgather(t)], idle=True)[0] is t


def test_nonblocking_checks_match_blocking(comm):
    with pytest.raises(ValueError, match=r"ireduce_scatter needs tensor.shape\[0\] divisible by "
                                         r"the communicator size 3.*shape \(4, 2\)"):
        wider(comm, 3).ireduce_scatter(torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"iallgather: out has shape \(2, 3\).*needs \(6, 3\)"):
        comm.iallgather(torch.ones(2, 3), out=torch.empty(2, 3))
    comm.size = 1
    with pytest.raises(ValueError, match="0-d tensor"):
        comm.iallgather(torch.tensor(1.0))
    with pytest.raises(ValueError, match="op='avg' needs a floating-point tensor"):
        comm.iallreduce(torch.ones(2, dtype=torch.int64), op="avg")
    with pytest.raises(ValueError, match="bool tensors"):
        comm.ireduce_scatter(torch.ones(2, dtype=torch.bool), op="prod")
    with pytest.raises(ValueError, match="not contiguous"):
        comm.iallreduce(torch.ones(3, 4).t())
    with pytest.raises(TypeError, match="complex64"):
        comm.iallgather(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="overlaps"):
        t = torch.ones(4)
        comm.ireduce_scatter(t, out=t)


class _Pending(Request):
    """A request that completes after ``polls`` calls of test()."""

    def __init__(self, polls):
        self.polls, self.waited = polls, False

    def wait(self):
        self.waited = True

    def test(self):
        self.polls -= 1
        return self.polls <= 0


def test_collective_request_finishes_once():
    calls, out = [], torch.zeros(2)
    req = CollectiveRequest(_Pending(3), out, finish=lambda: calls.append(1), keep=[out])
    assert not req.test() and not req.test() and calls == []
    assert req.test() and calls == [1]  # complete: finished without blocking
    assert req.test() and req.wait() is out and calls == [1]
    req = CollectiveRequest(_Pending(99), out, finish=lambda: calls.append(2))
    assert req.wait() is out and calls == [1, 2] and req.test()


def test_default_hooks_block_then_complete(comm):
    """A backend without non-blocking collectives still works: the base hooks run the
    blocking ones and return a completed request."""
    t = torch.ones(4)
    for req in (Communicator._iallreduce(comm, t, "sum"),
                Communicator._iallgather(comm, t, torch.empty(4)),
                Communicator._ireduce_scatter(comm, t, torch.empty(4), "sum")):
        assert isinstance(req, CompletedRequest) and req.test()


def test_mpi_buffer_is_zero_copy():
    from hpctrain.runtime.comm.mpi import _as_buffer
    t = torch.zeros(4, 3)
    view = _as_buffer(t)[0]
    assert np.shares_memory(view, t.numpy())
    view[0, 0] = 5.0  # a write through the buffer is visible in the tensor
    assert t[0, 0] == 5.0
    h = torch.zeros(7, dtype=torch.float16)
    assert _as_buffer(h)[0].ctypes.data == h.data_ptr()


def test_non_contiguous_tensor(comm):
    with pytest.raises(ValueError, match=r"not contiguous.*\.contiguous\(\)"):
        comm.allreduce(torch.ones(3, 4).t())


def test_unknown_op(comm):
    with pytest.raises(ValueError, match="unknown reduction op 'mean'.*sum, avg, max, min, prod"):
        comm.allreduce(torch.ones(2), op="mean")
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.allreduce_scalars([1.0], op="or")


def test_reduce_scatter_indivisible(comm):
    with pytest.raises(ValueError, match=r"divisible by the communicator size 3.*shape \(4, 2\)"):
        wider(comm, 3).reduce_scatter(torch.ones(4, 2))
    with pytest.raises(ValueError, match="divisible"):
        comm.alltoall(torch.ones(5))


def test_dim0_ops_reject_scalars(comm):
    with pytest.raises(ValueError, match="0-d tensor"):
        comm.allgather(torch.tensor(1.0))


def test_wrong_device(comm):
    with pytest.raises(ValueError, match=r"is on meta but the 'mpi' backend.*\.to\(comm\.device\)"):
        comm.allreduce(torch.empty(3, device="meta"))


def test_bad_dtype_and_type(comm):
    with pytest.raises(TypeError, match="complex64"):
        comm.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got ndarray"):
        comm.allreduce(np.ones(2))
    with pytest.raises(TypeError, match="sequence of real numbers"):
        comm.allreduce_scalars(["1.0"])


def test_op_dtype_mismatch(comm):
    with pytest.raises(ValueError, match="op='avg' needs a floating-point tensor, got torch.int64"):
        comm.allreduce(torch.ones(2, dtype=torch.int64), op="avg")
    with pytest.raises(ValueError, match="bool tensors"):
        comm.allreduce(torch.ones(2, dtype=torch.bool), op="sum")


def test_bad_out(comm):
    t = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"out has shape \(2, 3\).*needs \(4, 3\)"):
        wider(comm, 2).allgather(t, out=torch.empty(2, 3))
    comm.size = 1
    with pytest.raises(TypeError, match="out has dtype torch.float64"):
        comm.allgather(t, out=torch.empty(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="overlaps"):
        comm.alltoall(t, out=t)


def test_bad_ranks_and_colors(comm):
    with pytest.raises(ValueError, match="root=1 is not a rank"):
        comm.broadcast(torch.ones(1), root=1)
    with pytest.raises(TypeError, match="dest must be an int"):
        comm.send(torch.ones(1), dest=0.0)
    with pytest.raises(ValueError, match="tag must be a non-negative int"):
        comm.isend(torch.ones(1), dest=0, tag=-1)
    with pytest.raises(ValueError, match="color must be a non-negative int or None"):
        comm.split(-1)


def test_split_and_null(comm):
    sub = comm.split(0)
    assert sub.size == 1 and sub is not comm
    assert torch.equal(sub.allreduce(torch.ones(2)), torch.ones(2))
    sub.free()
    null = comm.split(None)
    assert isinstance(null, NullCommunicator)
    assert (null.is_active, null.rank, null.size) == (False, -1, 0)
    for call in (lambda: null.allreduce(torch.ones(1)), null.barrier,
                 lambda: null.recv(torch.ones(1), 0), lambda: null.split(0),
                 lambda: null.iallreduce(torch.ones(1)), lambda: null.iallgather(torch.ones(1)),
                 lambda: null.ireduce_scatter(torch.ones(1))):
        with pytest.raises(RuntimeError, match="not a member of this communicator"):
            call()
    null.free()


def test_torchdist_create_checks(comm):
    with pytest.raises(ValueError, match="backend must be one of"):
        TorchDistCommunicator.create(comm, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            TorchDistCommunicator.create(comm, backend="nccl")
