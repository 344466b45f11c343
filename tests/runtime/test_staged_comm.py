"""The staged communicator (MPI for device tensors through host memory) and its selection.

No GPU here: the communicator is built on the CPU with ``force_staging=True``, which runs the
same copies through separate host buffers as on a GPU."""

import os

import pytest
import torch

from hpctrain.errors import EnvError
from hpctrain.runtime.comm import CollectiveRequest, NullCommunicator, StagedCommunicator
from hpctrain.runtime.world import comm_choice, device_comm_kind
from tests.mpirun import run_worker_json

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def staged():
    """A 1-rank staged communicator that copies through host buffers."""
    from mpi4py import MPI

    from hpctrain.runtime.comm.mpi import MPICommunicator
    return StagedCommunicator(MPICommunicator(MPI.COMM_SELF), torch.device("cpu"),
                              force_staging=True)


@pytest.mark.mpi
def test_every_op_at_two_ranks_equals_plain_mpi(tmp_path):
    """One launch: comm_worker's exact checks on the staged communicator (every op, dtype,
    completion path, split), then every op against the plain MPICommunicator bit for bit,
    and the flight recorder's entries of the staged ops."""
    got = run_worker_json(os.path.join(HERE, "staged_worker.py"), tmp_path / "out.json", 2, [],
                          timeout=60)
    assert got["size"] == 2
    assert "comm_worker" in got["checked"] and "boxes two sides" in got["checked"]
    assert len(got["checked"]) >= 50
    assert got["flight"]["pending"] == 0 and got["flight"]["unended"] == 0
    assert {"allreduce", "iallreduce", "irecv_boxes", "isend_boxes", "p2p_group", "send",
            "recv", "split"} <= set(got["flight"]["ops"])


def test_attributes_and_wrong_device(staged):
    assert (staged.backend, staged.rank, staged.size) == ("mpi-staged", 0, 1)
    assert staged.device == torch.device("cpu") and staged.world_ranks() == [0]
    with pytest.raises(TypeError, match="wraps an MPICommunicator"):
        StagedCommunicator(object(), "cpu")
    with pytest.raises(ValueError, match="'mpi-staged' backend communicates tensors on cpu"):
        staged.allreduce(torch.ones(2, device="meta"))


def test_receives_into_boxes_copy_back_only_the_boxes(staged):
    """Two receives into one tensor at once (from this rank itself): each writes only its
    boxes, whatever order they complete in."""
    src = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6)
    win = torch.full((2, 5, 6), -1.0)
    box_a, box_b = (((0, 2), (0, 6)),), (((3, 5), (1, 3)), ((4, 5), (4, 6)))
    reqs = [staged.irecv_boxes(win, box_a, 0, tag=1), staged.irecv_boxes(win, box_b, 0, tag=2),
            staged.isend_boxes(src, box_b, 0, tag=2), staged.isend_boxes(src, box_a, 0, tag=1)]
    for r in reversed(reqs):
        r.wait()
    want = torch.full((2, 5, 6), -1.0)
    for box in box_a + box_b:
        idx = (Ellipsis, *(slice(lo, hi) for lo, hi in box))
        want[idx] = src[idx]
    assert torch.equal(win, want)


def test_hooks_get_host_copies_and_copy_back_on_completion(staged):
    """MPI sees separate buffers (never the caller's memory), the stream is synchronised
    before MPI reads them, and a receive lands in the caller's tensor only on completion."""
    calls = []
    inner = staged._inner
    for name in ("_isend", "_irecv"):
        orig = getattr(inner, name)

        def spy(t, peer, tag, orig=orig, name=name):
            calls.append((name, t.data_ptr()))
            return orig(t, peer, tag)
        setattr(inner, name, spy)
    staged._sync = lambda: calls.append(("sync", None))
    x, y = torch.arange(4.0), torch.zeros(4)
    recv = staged.irecv(y, 0, tag=3)
    send = staged.isend(x, 0, tag=3)
    assert isinstance(recv, CollectiveRequest)
    send.wait()
    assert [c[0] for c in calls] == ["_irecv", "sync", "_isend"]
    assert calls[0][1] != y.data_ptr() and calls[2][1] != x.data_ptr()
    recv.wait()
    assert torch.equal(y, x)


def test_split(staged):
    sub = staged.split(0, name="dp")
    assert isinstance(sub, StagedCommunicator) and sub.name == "dp" and sub._force
    t = torch.ones(3)
    assert sub.allreduce(t) is t and torch.equal(t, torch.ones(3))
    sub.free()
    null = staged.split(None)
    assert isinstance(null, NullCommunicator) and null.backend == "mpi-staged"


def test_cpu_without_force_hands_tensors_to_mpi(staged):
    plain = StagedCommunicator(staged._inner, "cpu")
    t = torch.ones(2)
    assert plain._to_host(t)[0] is t and plain._empty(t) is t


def test_comm_choice():
    assert comm_choice({}) == "auto"
    assert comm_choice({"HPCTRAIN_COMM": " MPI "}) == "mpi"
    assert comm_choice({"HPCTRAIN_COMM": "nccl"}) == "nccl"
    with pytest.raises(EnvError, match=r"HPCTRAIN_COMM='gloo' is not one of auto, nccl, mpi; "
                                       "fix: set it"):
        comm_choice({"HPCTRAIN_COMM": "gloo"})


@pytest.mark.parametrize("env, local_size, gpus, kind, says", [
    ({}, 4, 4, "nccl", False),                        # one rank per GPU
    ({}, 2, 1, "mpi", True),                          # two ranks share the GPU: auto says so
    ({"HPCTRAIN_COMM": "auto"}, 8, 4, "mpi", True),
    ({"HPCTRAIN_COMM": "mpi"}, 4, 4, "mpi", False),   # forced: no notice
    ({"HPCTRAIN_COMM": "mpi"}, 2, 1, "mpi", False),
    ({"HPCTRAIN_COMM": "nccl"}, 1, 1, "nccl", False),
])
def test_device_comm_kind(env, local_size, gpus, kind, says):
    got, why = device_comm_kind(env, local_size, gpus)
    assert got == kind and bool(why) == says
    if says:
        assert f"{local_size} ranks on a node share {gpus} GPU(s)" in why


def test_nccl_on_a_shared_gpu_is_refused():
    with pytest.raises(EnvError, match=r"HPCTRAIN_COMM=nccl but 2 ranks on a node share 1 "
                                       r"GPU\(s\).*fix: set HPCTRAIN_COMM=mpi"):
        device_comm_kind({"HPCTRAIN_COMM": "nccl"}, 2, 1)


def test_world_counts_ranks_per_physical_gpu(staged, monkeypatch, capsys):
    """init_world's GPU branch: ranks on one host with the same GPU make it pick the staged
    communicator (and say so once); the same GPU index on two hosts does not."""
    from hpctrain.runtime import world

    class FakeWorld:
        def __init__(self, ids):
            self.ids = ids

        def allgather(self, _):
            return self.ids

    monkeypatch.setattr(world, "_gpu_id", lambda dev, env: "x")
    comm = world._device_comm(FakeWorld([("a", "0"), ("a", "1"), ("a", "1")]), staged._inner,
                              torch.device("cpu"), {})
    assert isinstance(comm, StagedCommunicator) and comm.name == "world.staged"
    assert capsys.readouterr().out.count("hpctrain: 3 ranks on a node share 2 GPU(s)") == 1
    made = []
    monkeypatch.setattr("hpctrain.runtime.comm.torchdist.TorchDistCommunicator.create",
                        lambda *a, **k: made.append(k) or staged)
    world._device_comm(FakeWorld([("a", "0"), ("b", "0")]), staged._inner,
                       torch.device("cpu"), {})
    assert made == [{"backend": "nccl"}]


def test_gpu_id_names_the_physical_gpu(monkeypatch):
    """The same GPU gives the same id in every process (uuid bytes, a uuid string, the PCI
    address, else the CUDA_VISIBLE_DEVICES entry), never an object's address."""
    from types import SimpleNamespace

    from hpctrain.runtime import world

    def gpu_id(props, index=0, env=None):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
        return world._gpu_id(torch.device("cuda", index), env or {})

    assert gpu_id(SimpleNamespace(uuid=SimpleNamespace(bytes=b"\x01\xab"))) == "01ab"
    assert gpu_id(SimpleNamespace(uuid="GPU-1234")) == "GPU-1234"
    assert gpu_id(SimpleNamespace(uuid="<_CUuuid object at 0x7f>", pci_bus_id=3)) == "pci:0:3:0"
    assert gpu_id(SimpleNamespace(), 1, {"CUDA_VISIBLE_DEVICES": "2, 5"}) == "5"
    assert gpu_id(SimpleNamespace(), 1) == "1"
