"""Work out who started this process and where it sits in the job, from the environment alone."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

__all__ = ["LaunchInfo", "detect_launcher", "parse_tasks_per_node"]

# No "pmix": a bare PMIx launch carries no world size in the environment (see below).
LAUNCHERS = ("openmpi", "pals", "hydra", "slurm", "torchrun", "single")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as its launcher told it."""

    launcher: str  # one of LAUNCHERS
    rank: int
    size: int
    local_rank: int
    local_size: int | None
    node_rank: int | None
    num_nodes: int | None
    job_id: str | None

    def describe(self) -> str:
        """Return one short human line, e.g. ``slurm: rank 3/4, local 1/2, node 1/2, job 42``."""
        parts = [f"{self.launcher}: rank {self.rank}/{self.size}",
                 f"local {self.local_rank}/{_or_q(self.local_size)}"]
        if self.node_rank is not None:
            parts.append(f"node {self.node_rank}/{_or_q(self.num_nodes)}")
        elif self.num_nodes is not None:
            parts.append(f"{self.num_nodes} node(s)")
        if self.job_id:
            parts.append(f"job {self.job_id}")
        return ", ".join(parts)


def _or_q(value: int | None) -> str:
    return "?" if value is None else str(value)


def _get(env: Mapping[str, str], name: str) -> str | None:
    # An exported-but-empty variable ("VAR=") means unset in batch scripts.
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str) -> int:
    """Return the integer in ``env[name]``; raise ValueError naming it when absent or malformed."""
    raw = _get(env, name)
    if raw is None:
        raise ValueError(f"{name} is not set, but the launcher's other variables are")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    """Return the integer in ``env[name]``, or None when it is not set."""
    return None if _get(env, name) is None else _int(env, name)


def _first(env: Mapping[str, str], *names: str) -> str | None:
    """Return the first of ``names`` that is set, or None."""
    return next((n for n in names if _get(env, n) is not None), None)


def _job_id(env: Mapping[str, str]) -> str | None:
    # The batch job, whichever launcher runs inside it.
    name = _first(env, "SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "LSB_JOBID")
    return None if name is None else _get(env, name)


_TPN_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's compressed tasks-per-node list: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for item in value.strip().split(","):
        m = _TPN_ITEM.match(item.strip())
        if m is None:
            raise ValueError(f"{name}={value!r} is not a Slurm tasks-per-node list "
                             f"like '4(x2),3' (bad item {item!r})")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _in_range(index: int, index_var: str, count: int | None, count_var: str) -> None:
    """Raise ValueError unless ``0 <= index < count`` (count None: only ``index >= 0``)."""
    if count is not None and count < 1:
        raise ValueError(f"{count_var}={count} must be at least 1")
    if index < 0 or (count is not None and index >= count):
        bound = "" if count is None else f" (must be < {count_var}={count})"
        raise ValueError(f"{index_var}={index} is out of range{bound}")


def _make(launcher: str, env: Mapping[str, str], *, rank: tuple[int, str], size: tuple[int, str],
          local_rank: tuple[int, str], local_size: tuple[int | None, str],
          node_rank: tuple[int | None, str] = (None, ""),
          num_nodes: tuple[int | None, str] = (None, ""),
          job_id: str | None = None) -> LaunchInfo:
    """Validate (value, variable-name) pairs and build the LaunchInfo."""
    _in_range(rank[0], rank[1], size[0], size[1])
    _in_range(local_rank[0], local_rank[1], local_size[0], local_size[1])
    if local_size[0] is not None and local_size[0] > size[0]:
        raise ValueError(f"{local_size[1]}={local_size[0]} exceeds {size[1]}={size[0]}")
    if node_rank[0] is not None:
        _in_range(node_rank[0], node_rank[1], num_nodes[0], num_nodes[1])
    elif num_nodes[0] is not None and num_nodes[0] < 1:
        raise ValueError(f"{num_nodes[1]}={num_nodes[0]} must be at least 1")
    return LaunchInfo(launcher, rank[0], size[0], local_rank[0], local_size[0],
                      node_rank[0], num_nodes[0], job_id if job_id is not None else _job_id(env))


def _from_openmpi(env: Mapping[str, str]) -> LaunchInfo:
    # OMPI_COMM_WORLD_NODE_RANK is NOT the node index: Open MPI documents it as this
    # process's rank among all jobs' processes on the node, so the node index stays unknown.
    return _make(
        "openmpi", env,
        rank=(_int(env, "OMPI_COMM_WORLD_RANK"), "OMPI_COMM_WORLD_RANK"),
        size=(_int(env, "OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE"),
        local_rank=(_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), "OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size=(_opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), "OMPI_COMM_WORLD_LOCAL_SIZE"))


def _from_pals(env: Mapping[str, str]) -> LaunchInfo:
    # PALS gives no world size; Cray PMI, which every PALS launch sets up, does (PMI_SIZE).
    if _get(env, "PMI_SIZE") is None:
        raise ValueError("PALS_RANKID is set but PMI_SIZE (the world size Cray PMI exports "
                         "under PALS) is not; launch with PALS mpiexec from cray-pals")
    return _make(
        "pals", env,
        rank=(_int(env, "PALS_RANKID"), "PALS_RANKID"),
        size=(_int(env, "PMI_SIZE"), "PMI_SIZE"),
        local_rank=(_int(env, "PALS_LOCAL_RANKID"), "PALS_LOCAL_RANKID"),
        local_size=(_opt_int(env, "PALS_LOCAL_SIZE"), "PALS_LOCAL_SIZE"),
        node_rank=(_opt_int(env, "PALS_NODEID"), "PALS_NODEID"))


def _from_hydra(env: Mapping[str, str]) -> LaunchInfo:
    return _make(
        "hydra", env,
        rank=(_int(env, "PMI_RANK"), "PMI_RANK"),
        size=(_int(env, "PMI_SIZE"), "PMI_SIZE"),
        local_rank=(_int(env, "MPI_LOCALRANKID"), "MPI_LOCALRANKID"),
        local_size=(_opt_int(env, "MPI_LOCALNRANKS"), "MPI_LOCALNRANKS"))


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    # Prefer the step's own counts: inside an allocation, srun -n/-N may use less of it.
    size_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or "SLURM_NTASKS"
    nodes_var = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    tpn_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    node_rank = _opt_int(env, "SLURM_NODEID")
    num_nodes = None if nodes_var is None else _int(env, nodes_var)
    local_size = None
    if tpn_var is not None:
        counts = parse_tasks_per_node(env[tpn_var], tpn_var)
        if node_rank is not None:
            if node_rank >= len(counts):
                raise ValueError(f"SLURM_NODEID={node_rank} is out of range for "
                                 f"{tpn_var}={env[tpn_var]!r} ({len(counts)} node(s))")
            local_size = counts[node_rank]
        elif len(counts) == 1:
            local_size = counts[0]
    return _make(
        "slurm", env,
        rank=(_int(env, "SLURM_PROCID"), "SLURM_PROCID"),
        size=(_int(env, size_var), size_var),
        local_rank=(_int(env, "SLURM_LOCALID"), "SLURM_LOCALID"),
        local_size=(local_size, tpn_var or ""),
        node_rank=(node_rank, "SLURM_NODEID"),
        num_nodes=(num_nodes, nodes_var or ""))


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    # torchrun sets all three; guessing a missing LOCAL_RANK would pile ranks onto one GPU.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if _get(env, name) is None:
            raise ValueError(f"{name} is not set but other torchrun variables (RANK, WORLD_SIZE, "
                             f"LOCAL_RANK) are: launch with torchrun, or unset the stray ones")
    return _make(
        "torchrun", env,
        rank=(_int(env, "RANK"), "RANK"),
        size=(_int(env, "WORLD_SIZE"), "WORLD_SIZE"),
        local_rank=(_int(env, "LOCAL_RANK"), "LOCAL_RANK"),
        local_size=(_opt_int(env, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE"),
        node_rank=(_opt_int(env, "GROUP_RANK"), "GROUP_RANK"),
        num_nodes=(_opt_int(env, "GROUP_WORLD_SIZE"), "GROUP_WORLD_SIZE"),
        job_id=_torchrun_id(env) or _job_id(env))


def _torchrun_id(env: Mapping[str, str]) -> str | None:
    # torchrun's default --rdzv-id is the literal "none": no id at all.
    run_id = _get(env, "TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "none") else run_id


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    # srun sets SLURM_STEP_ID for every task; the batch script itself also has
    # SLURM_PROCID=0 (and SLURM_NTASKS=N) but no step id, and is one process. A task
    # other than 0 is never the batch script, with or without a step id.
    procid = _get(env, "SLURM_PROCID")
    return procid is not None and (
        _first(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None or procid != "0")


def detect_launcher(env: Mapping[str, str]) -> LaunchInfo:
    """Return this process's LaunchInfo; raise ValueError on a malformed variable.

    Launchers nest (an allocation's batch script runs mpirun, srun runs torchrun) and
    children inherit their parent's variables, so the innermost launcher's per-rank
    variables must win. Order, innermost first:

    1. torchrun, when its agent marker TORCHELASTIC_RUN_ID is set: torchrun is started by
       srun/mpirun once per node, so SLURM_PROCID/OMPI_* there count nodes, not workers.
    2. Open MPI (OMPI_COMM_WORLD_*), 3. Cray PALS (PALS_*), 4. Hydra (PMI_* with
       MPI_LOCALRANKID): all run inside SLURM/PBS allocations and inherit the batch
       script's SLURM_PROCID=0, or their daemons' SLURM_* when started through srun.
       PALS comes before Hydra because Cray PMI also sets PMI_RANK under PALS.
    5. Slurm srun (SLURM_PROCID in a step; PMI_RANK without MPI_LOCALRANKID is srun's
       own --mpi=pmi2 and lands here too).
    6. bare PMIX_RANK (srun --mpi=pmix and Open MPI set it too, so it matters only when
       nothing above matched): rejected, as PMIx keeps the world size out of the environment.
    7. RANK/WORLD_SIZE/LOCAL_RANK without the agent marker (torchrun-style exports).
    8. nothing: a single process, rank 0 of 1.
    """
    if _get(env, "TORCHELASTIC_RUN_ID") is not None:
        return _from_torchrun(env)
    if _get(env, "OMPI_COMM_WORLD_RANK") is not None:
        return _from_openmpi(env)
    if _get(env, "PALS_RANKID") is not None:
        return _from_pals(env)
    if _get(env, "PMI_RANK") is not None and (
            _get(env, "MPI_LOCALRANKID") is not None or not _in_slurm_step(env)):
        return _from_hydra(env)
    if _in_slurm_step(env):
        return _from_slurm(env)
    if _get(env, "PMIX_RANK") is not None:
        # PMIx publishes the world size only through its API, never in the environment.
        raise ValueError(f"PMIX_RANK={env['PMIX_RANK']!r} is set but no launcher variable "
                         "gives the world size (PMIx publishes it only through its API); "
                         "launch with srun or mpirun, which also export SLURM_*/OMPI_*")
    if _first(env, "RANK", "WORLD_SIZE") is not None:
        return _from_torchrun(env)
    return LaunchInfo("single", 0, 1, 0, 1, 0, 1, _job_id(env))
