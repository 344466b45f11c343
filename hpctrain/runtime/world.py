"""The world: MPI init, ranks, nodes, the device of this rank, and its communicators."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping

import torch

from hpctrain.errors import EnvError, UsageError
from hpctrain.runtime.abort import arm_agreement, install_excepthook
from hpctrain.runtime.comm import Communicator
from hpctrain.runtime.device import bind_device, positive_int_env
from hpctrain.runtime.launcher import LaunchInfo, detect_launcher

__all__ = ["World", "init_world", "ranks_per_node_override", "check_launch_size",
           "mpi_yield_default", "comm_choice", "device_comm_kind"]

_WORLD: "World | None" = None


@dataclass
class World:
    """Everything a rank knows about the job. Built once per process by init_world()."""

    launch: LaunchInfo
    mpi_comm: object            # mpi4py MPI.Comm of all ranks (for Horovod and parallel HDF5)
    host: Communicator          # MPI communicator over all ranks, host (CPU) tensors
    comm: Communicator          # device communicator over all ranks (MPI on CPU; NCCL, or MPI
                                # staged through host memory, on GPU: device_comm_kind)
    node: Communicator          # ranks on this node (host side)
    cross: Communicator         # ranks with the same local rank on every node (host side)
    device: torch.device
    _meshes: dict = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int:
        return self.host.rank

    @property
    def size(self) -> int:
        return self.host.size

    @property
    def local_rank(self) -> int:
        return self.node.rank

    @property
    def local_size(self) -> int:
        return self.node.size

    @property
    def node_rank(self) -> int:
        return self.cross.rank

    @property
    def num_nodes(self) -> int:
        return self.cross.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(self, layout):
        """Return the Mesh for a layout (built on first use; collective over all ranks)."""
        from hpctrain.runtime.mesh import Mesh, MeshLayout

        layout = MeshLayout.parse(layout) if isinstance(layout, str) else layout
        key = layout.resolve(self.size)
        if key not in self._meshes:
            self._meshes[key] = Mesh(self.comm, key)
        return self._meshes[key]

    def describe(self, strategy: str = "", mesh: str = "") -> str:
        """One line for rank 0 to print at start: launcher, ranks, nodes, device, mesh, strategy."""
        parts = [f"launcher={self.launch.launcher}", f"ranks={self.size}", f"nodes={self.num_nodes}",
                 f"ranks/node={self.local_size}", f"device={self.device.type}",
                 f"comm={self.comm.backend}"]
        parts.append(f"mesh={mesh or f'dp={self.size}'}")  # no mesh: every rank data parallel
        if strategy:
            parts.append(f"strategy={strategy}")
        return "hpctrain: " + " ".join(parts)


def ranks_per_node_override(env: Mapping[str, str], configured: int = 0) -> int:
    """Return the ranks-per-node to pretend (0: use the real nodes); config wins over env."""
    if configured:
        return configured
    return positive_int_env(env, "HPCTRAIN_RANKS_PER_NODE") or 0


_LAUNCH_FIX = {
    "torchrun": "launch with mpirun -n N or srun --mpi=pmix (hpctrain's ranks come from MPI, "
                "not from torchrun's rendezvous)",
    "slurm": "launch with srun --mpi=pmix (or the PMI plugin your MPI was built for; `srun "
             "--mpi=list` shows them), or with mpirun inside the allocation",
}


def check_launch_size(launch: LaunchInfo, mpi_size: int | None = None) -> None:
    """Refuse a launcher whose ranks MPI does not see (N separate one-rank trainings).

    torchrun, or srun without a PMI plugin that MPI understands, starts N processes that each
    initialise MPI alone: every one would train the whole model and write the same files.
    Before MPI starts (``mpi_size`` None) only torchrun is known for sure to be such a launch.
    """
    if launch.size <= 1 or launch.size == mpi_size:
        return
    if mpi_size is None and launch.launcher != "torchrun":
        return
    seen = "no MPI launcher" if mpi_size is None else f"MPI sees {mpi_size} rank(s) in its world"
    fix = _LAUNCH_FIX.get(launch.launcher, "launch with your MPI's own mpirun/mpiexec, or "
                                           "with srun --mpi=pmix")
    raise UsageError(f"the {launch.launcher} launcher started {launch.size} processes, but "
                     f"{seen}: each process would train alone. Fix: {fix}")


COMM_ENV = "HPCTRAIN_COMM"
_COMM_CHOICES = ("auto", "nccl", "mpi")


def comm_choice(env: Mapping[str, str]) -> str:
    """HPCTRAIN_COMM (the GPU device communicator): auto (unset), nccl or mpi; EnvError else."""
    raw = (env.get(COMM_ENV) or "").strip().lower()
    if not raw:
        return "auto"
    if raw not in _COMM_CHOICES:
        raise EnvError(f"{COMM_ENV}={env[COMM_ENV]!r} is not one of {', '.join(_COMM_CHOICES)}; "
                       "fix: set it to one of those (mpi: MPI staged through host memory, for "
                       "ranks that share a GPU) or unset it")
    return raw


def device_comm_kind(env: Mapping[str, str], local_size: int, gpus: int) -> tuple[str, str]:
    """("nccl" | "mpi", why) for a GPU job's device communicator. ``local_size``: the ranks on
    the most crowded node, ``gpus``: the distinct GPUs they use. NCCL takes one rank per GPU,
    so auto picks MPI staged through host memory when ranks share a GPU; ``why`` then says so
    (empty otherwise). HPCTRAIN_COMM=nccl on shared GPUs is refused (NCCL would fail later
    with "duplicate GPU")."""
    choice = comm_choice(env)
    shared = local_size > gpus
    if choice == "nccl" and shared:
        raise EnvError(f"{COMM_ENV}=nccl but {local_size} ranks on a node share {gpus} GPU(s), "
                       "and NCCL takes one rank per GPU; fix: set HPCTRAIN_COMM=mpi (or auto), "
                       "or launch one rank per GPU")
    if choice == "auto" and shared:
        return "mpi", (f"{local_size} ranks on a node share {gpus} GPU(s) and NCCL takes one "
                       "rank per GPU: the device communicator is MPI staged through host "
                       f"memory (slower); {COMM_ENV}=mpi|nccl chooses")
    return ("nccl" if choice == "auto" else choice), ""


def _gpu_id(device: torch.device, env: Mapping[str, str]) -> str:
    """This rank's physical GPU, as the ranks of a node can compare it."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)  # torch's _CUuuid: .bytes, or a str
    raw = getattr(uuid, "bytes", None)
    text = raw.hex() if isinstance(raw, bytes) else str(uuid or "")
    if text and " at 0x" not in text:  # never a per-process object repr
        return text
    if hasattr(props, "pci_bus_id"):
        pci = (getattr(props, "pci_domain_id", 0), props.pci_bus_id,
               getattr(props, "pci_device_id", 0))
        return "pci:" + ":".join(map(str, pci))
    visible = [d.strip() for d in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if d.strip()]
    index = device.index or 0
    return visible[index] if index < len(visible) else str(index)


def _device_comm(world_mpi, host, dev: torch.device, env: Mapping[str, str]) -> Communicator:
    """The device communicator of a GPU rank: NCCL, or MPI staged through host memory
    (device_comm_kind); collective over all ranks, which all take the same kind."""
    # Every rank needs the same verdict: count ranks per physical GPU over the whole world
    # (pretended nodes, HPCTRAIN_RANKS_PER_NODE, may split the ranks of one GPU).
    ids = world_mpi.allgather((socket.gethostname(), _gpu_id(dev, env)))
    per_host: dict = {}
    for host_name, gpu in ids:
        per_host.setdefault(host_name, []).append(gpu)
    local_size, gpus = max(((len(g) - len(set(g)), len(g), len(set(g)))
                            for g in per_host.values()))[1:]
    kind, why = device_comm_kind(env, local_size, gpus)
    if kind == "mpi":
        from hpctrain.runtime.comm.staged import StagedCommunicator

        if why and host.rank == 0:
            print(f"hpctrain: {why}", flush=True)
        comm = StagedCommunicator(host, dev)
        comm.name = "world.staged"
        return comm
    from hpctrain.runtime.comm.torchdist import TorchDistCommunicator

    comm = TorchDistCommunicator.create(world_mpi, backend="nccl")
    comm.name = "world.nccl"
    return comm


_YIELD = "OMPI_MCA_mpi_yield_when_idle"


def mpi_yield_default(env: Mapping[str, str], cores: int | None = None) -> str | None:
    """The Open MPI mpi_yield_when_idle to set before MPI starts: "1" when the launcher put at
    least as many ranks on this node as this process may use cores, None otherwise or when
    the user set it.

    Open MPI busy-polls inside blocking calls. With no spare core (2 ranks on 2 cores, and
    Horovod's background thread besides), a waiting rank then takes cycles from the rank it
    waits for; yielding gives them back (``bench step``: Horovod ddp's CPU per step fell from
    about 2x to 1.1-1.3x the no-communication floor). Open MPI turns it on by itself only when
    it counts more ranks than slots."""
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if _YIELD in env or not local or not local.isdigit():
        return None
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return "1" if int(local) >= cores else None


def init_world(ranks_per_node: int = 0, device: str = "auto", env: Mapping[str, str] | None = None) -> World:
    """Initialise MPI and build the world (collective over all ranks; idempotent per process).

    ranks_per_node > 0 pretends nodes of that many consecutive ranks, so multi-node layouts
    (HYBRID_SHARD, cross-node groups) can be tested on one machine. From here on an
    exception that reaches the top of the script prints its rank and aborts every rank.
    Raises UsageError when the launcher started processes that MPI does not see as one job.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    env = os.environ if env is None else env
    install_excepthook()  # API scripts too: an exception on one rank ends the job, never hangs
    launch = detect_launcher(env)
    from hpctrain.runtime.malloc import tune_malloc

    tune_malloc(env)  # HPCTRAIN_MMAP_THRESHOLD_KB, before the model grows the heap (malloc.py)
    comm_choice(env)  # HPCTRAIN_COMM: refused before MPI when unclear
    per_node = ranks_per_node_override(env, ranks_per_node)

    if (value := mpi_yield_default(env)) is not None:
        os.environ[_YIELD] = value  # read by Open MPI's init, which the import below runs

    from mpi4py import MPI  # initialises MPI (thread level MPI_THREAD_MULTIPLE by default)

    from hpctrain.runtime.comm.mpi import MPICommunicator

    world_mpi = MPI.COMM_WORLD
    rank, size = world_mpi.Get_rank(), world_mpi.Get_size()
    arm_agreement(world_mpi)  # from here a user error on every rank is one line (abort.py)
    check_launch_size(launch, size)
    if per_node:
        if size % per_node:
            raise UsageError(f"ranks_per_node={per_node} does not divide the world size {size}; "
                             f"launch a multiple of {per_node} ranks or change --ranks-per-node")
        node_mpi = world_mpi.Split(color=rank // per_node, key=rank)
    else:
        node_mpi = world_mpi.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross_mpi = world_mpi.Split(color=node_mpi.Get_rank(), key=rank)
    host = MPICommunicator(world_mpi)
    node = MPICommunicator(node_mpi)
    cross = MPICommunicator(cross_mpi)
    host.name, node.name, cross.name = "world", "node", "cross"  # flight-record group names

    dev = bind_device(node.rank, node.size, env, requested=device)
    if dev.type == "cuda":
        comm = _device_comm(world_mpi, host, dev, env)
    else:
        comm = host
    _WORLD = World(launch=launch, mpi_comm=world_mpi, host=host, comm=comm, node=node,
                   cross=cross, device=dev)
    return _WORLD
