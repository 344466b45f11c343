"""Launcher detection against recorded launcher environments."""

import pytest

from hpctrain.runtime.launcher import LaunchInfo, detect_launcher, parse_tasks_per_node

# --- Recorded environments (per-rank variables as each launcher sets them) ------------------

# sbatch -N 2 --ntasks-per-node=2 -c 8; srun python train.py   -> the task with rank 3
SRUN_4_ON_2_NODES = {
    "SLURM_JOB_ID": "812345", "SLURM_JOBID": "812345", "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "nid[001002-001003]", "SLURM_NODELIST": "nid[001002-001003]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_CPUS_PER_TASK": "8", "SLURM_CPUS_ON_NODE": "16",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "nid[001002-001003]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURMD_NODENAME": "nid001003", "SLURM_TASK_PID": "48213",
}

# sbatch -N 2 -n 7; srun python train.py (block distribution "4,3")  -> rank 5
SRUN_7_UNEVEN = {
    "SLURM_JOB_ID": "812350", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "7", "SLURM_NPROCS": "7", "SLURM_TASKS_PER_NODE": "4,3",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
}

# srun -N 1 -n 2 inside a 4-node allocation: the step's own counts must win.
SRUN_STEP_SMALLER_THAN_JOB = {
    "SLURM_JOB_ID": "812351", "SLURM_JOB_NUM_NODES": "4", "SLURM_TASKS_PER_NODE": "4(x4)",
    "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_STEP_ID": "3", "SLURM_STEPID": "3",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
}

# mpirun -n 4 on one node (Open MPI 4.1.4; recorded with `env` under mpirun) -> rank 2
MPIRUN_4_ONE_NODE = {
    "OMPI_APP_CTX_NUM_PROCS": "4", "OMPI_COMMAND": "python", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "2",
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_FIRST_RANKS": "0",
    "OMPI_MCA_ess": "^singleton", "OMPI_MCA_ess_base_jobid": "1265303553",
    "OMPI_MCA_ess_base_vpid": "2", "OMPI_UNIVERSE_SIZE": "4",
    "PMIX_NAMESPACE": "1265303553", "PMIX_RANK": "2",
}

# sbatch -N 2 --ntasks-per-node=4; mpirun -n 8 python train.py -> rank 5, on the second node.
# mpirun starts its daemons with srun, so this rank inherits the daemon step's SLURM_PROCID=1
# and SLURM_NTASKS=2, on top of the batch script's variables.
MPIRUN_IN_SBATCH_RANK5 = {
    "SLURM_JOB_ID": "812346", "SLURM_JOBID": "812346", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_UNIVERSE_SIZE": "8", "PMIX_RANK": "5", "PMIX_NAMESPACE": "3051945985",
}

# ... and rank 2 of the same job, on the batch node: it inherits the batch script's
# SLURM_PROCID=0 and SLURM_NTASKS=8 (no step id there).
MPIRUN_IN_SBATCH_RANK2 = {
    "SLURM_JOB_ID": "812346", "SLURM_JOBID": "812346", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "2",
    "OMPI_UNIVERSE_SIZE": "8", "PMIX_RANK": "2", "PMIX_NAMESPACE": "3051945985",
}

# MPICH mpiexec -n 4 -ppn 2 -hosts a,b (Hydra) -> rank 2 (first rank on host b)
HYDRA_4_PPN_2 = {
    "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "7", "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2", "HYDRA_CONTROL_FD": "9",
}

# Intel MPI mpiexec.hydra inside a Slurm allocation: its proxies are srun tasks, so each
# rank also carries the proxy step's SLURM_PROCID (= host index) -> rank 3 of 4
HYDRA_IN_SLURM = {
    "SLURM_JOB_ID": "812352", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
    "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "8", "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2", "I_MPI_HYDRA_BOOTSTRAP": "slurm",
}

# PBS job on a Cray EX; mpiexec -n 8 --ppn 4 --depth 8 (PALS) -> rank 6
PBS_PALS_RANK6 = {
    "PBS_JOBID": "1234567.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
    "PBS_NODEFILE": "/var/spool/pbs/aux/1234567.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
    "PBS_O_WORKDIR": "/home/u/run", "PALS_APID": "9a0f0e2c-5a1b-4d7e-8f3c-2b1a0c9d8e7f",
    "PALS_APINFO": "/var/run/palsd/9a0f0e2c/apinfo", "PALS_DEPTH": "8",
    "PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PALS_NODEID": "1", "PALS_LOCAL_SIZE": "4",
    "PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4",
    "PMI_UNIVERSE_SIZE": "8", "PMI_JOBID": "1234567", "PMI_CONTROL_PORT": "6000",
}

# torchrun --nnodes 2 --nproc-per-node 4 --rdzv-id 812347, started once per node by
# srun -N 2 --ntasks-per-node=1: the worker with global rank 6 (srun says node 1 of 2)
TORCHRUN_UNDER_SRUN = {
    "SLURM_JOB_ID": "812347", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
    "LOCAL_RANK": "2", "RANK": "6", "GROUP_RANK": "1", "ROLE_RANK": "6", "ROLE_NAME": "default",
    "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "nid001004", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "812347",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}

# torchrun --standalone --nproc-per-node 2 on a workstation -> rank 1 (default run id "none")
TORCHRUN_STANDALONE = {
    "LOCAL_RANK": "1", "RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
}

# srun --mpi=pmix -n 2 on one node -> rank 1 (PMIx variables too, but Slurm's give the size)
SRUN_PMIX = {
    "SLURM_JOB_ID": "812348", "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
    "SLURM_JOB_NUM_NODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "1",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_MPI_TYPE": "pmix",
    "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.812348.1",
    "PMIX_SERVER_URI41": "pmix-server.33125;tcp4://127.0.0.1:40623", "PMIX_VERSION": "4.2.2",
}

# srun --mpi=pmi2 -n 2: Slurm's PMI-2 plugin also exports PMI_RANK/PMI_SIZE (no Hydra ids).
SRUN_PMI2 = {
    "SLURM_JOB_ID": "812353", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "PMI_FD": "5", "PMI_JOBID": "812353.0", "PMI_RANK": "0", "PMI_SIZE": "2",
}

# python train.py run straight from an sbatch -n 8 script, without srun: one process.
SBATCH_SCRIPT_NO_SRUN = {
    "SLURM_JOB_ID": "812349", "SLURM_JOBID": "812349", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "64",
}

RECORDED = [
    ("srun -n 4 over 2 nodes", SRUN_4_ON_2_NODES,
     LaunchInfo("slurm", 3, 4, 1, 2, 1, 2, "812345")),
    ("srun -n 7 uneven", SRUN_7_UNEVEN, LaunchInfo("slurm", 5, 7, 1, 3, 1, 2, "812350")),
    ("srun step smaller than job", SRUN_STEP_SMALLER_THAN_JOB,
     LaunchInfo("slurm", 1, 2, 1, 2, 0, 1, "812351")),
    ("mpirun -n 4 on one node", MPIRUN_4_ONE_NODE,
     LaunchInfo("openmpi", 2, 4, 2, 4, None, None, None)),
    ("mpirun in sbatch, remote rank", MPIRUN_IN_SBATCH_RANK5,
     LaunchInfo("openmpi", 5, 8, 1, 4, None, None, "812346")),
    ("mpirun in sbatch, batch-node rank", MPIRUN_IN_SBATCH_RANK2,
     LaunchInfo("openmpi", 2, 8, 2, 4, None, None, "812346")),
    ("mpiexec (Hydra)", HYDRA_4_PPN_2, LaunchInfo("hydra", 2, 4, 0, 2, None, None, None)),
    ("mpiexec.hydra in Slurm", HYDRA_IN_SLURM,
     LaunchInfo("hydra", 3, 4, 1, 2, None, None, "812352")),
    ("PBS + PALS", PBS_PALS_RANK6,
     LaunchInfo("pals", 6, 8, 2, 4, 1, None,
                "1234567.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov")),
    ("torchrun under srun", TORCHRUN_UNDER_SRUN,
     LaunchInfo("torchrun", 6, 8, 2, 4, 1, 2, "812347")),
    ("torchrun --standalone", TORCHRUN_STANDALONE, LaunchInfo("torchrun", 1, 2, 1, 2, 0, 1, None)),
    ("srun --mpi=pmix", SRUN_PMIX, LaunchInfo("slurm", 1, 2, 1, 2, 0, 1, "812348")),
    ("srun --mpi=pmi2", SRUN_PMI2, LaunchInfo("slurm", 0, 2, 0, 2, 0, 1, "812353")),
    ("sbatch script without srun", SBATCH_SCRIPT_NO_SRUN,
     LaunchInfo("single", 0, 1, 0, 1, 0, 1, "812349")),
    ("empty env", {}, LaunchInfo("single", 0, 1, 0, 1, 0, 1, None)),
    # A task other than 0 is never the batch script, even without a step id.
    ("slurm task 1 without a step id", {
        "SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
     LaunchInfo("slurm", 1, 2, 1, None, None, None, "9")),
]


@pytest.mark.parametrize("env,expected", [r[1:] for r in RECORDED], ids=[r[0] for r in RECORDED])
def test_recorded_environments(env, expected):
    assert detect_launcher(env) == expected


def test_detect_does_not_modify_env():
    env = dict(MPIRUN_IN_SBATCH_RANK5)
    detect_launcher(env)
    assert env == MPIRUN_IN_SBATCH_RANK5


def _with(base, **changes):
    env = dict(base)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


MALFORMED = [
    ("non-integer slurm rank", _with(SRUN_4_ON_2_NODES, SLURM_PROCID="abc"), r"SLURM_PROCID='abc'"),
    ("slurm rank >= size", _with(SRUN_4_ON_2_NODES, SLURM_PROCID="4"), r"SLURM_PROCID=4"),
    ("negative slurm rank", _with(SRUN_4_ON_2_NODES, SLURM_PROCID="-1"), r"SLURM_PROCID=-1"),
    ("slurm node id past task list", _with(SRUN_4_ON_2_NODES, SLURM_NODEID="2"), r"SLURM_NODEID=2"),
    ("slurm local id >= tasks on node", _with(SRUN_7_UNEVEN, SLURM_LOCALID="3"),
     r"SLURM_LOCALID=3"),
    ("bad tasks-per-node", _with(SRUN_4_ON_2_NODES, SLURM_STEP_TASKS_PER_NODE="2(x2"),
     r"SLURM_STEP_TASKS_PER_NODE='2\(x2'"),
    ("slurm size missing", _with(SRUN_PMI2, SLURM_NTASKS=None), r"SLURM_NTASKS"),
    ("ompi rank >= size", _with(MPIRUN_4_ONE_NODE, OMPI_COMM_WORLD_RANK="4"),
     r"OMPI_COMM_WORLD_RANK=4"),
    ("ompi size zero", _with(MPIRUN_4_ONE_NODE, OMPI_COMM_WORLD_SIZE="0"),
     r"OMPI_COMM_WORLD_SIZE=0"),
    ("ompi non-integer local rank", _with(MPIRUN_4_ONE_NODE, OMPI_COMM_WORLD_LOCAL_RANK="x1"),
     r"OMPI_COMM_WORLD_LOCAL_RANK='x1'"),
    ("hydra rank >= size", _with(HYDRA_4_PPN_2, PMI_RANK="9"), r"PMI_RANK=9"),
    ("pals without PMI_SIZE", _with(PBS_PALS_RANK6, PMI_SIZE=None), r"PMI_SIZE"),
    ("pals non-integer rank", _with(PBS_PALS_RANK6, PALS_RANKID="six"), r"PALS_RANKID='six'"),
    ("torchrun rank >= world", _with(TORCHRUN_STANDALONE, RANK="2"), r"RANK=2"),
    ("RANK without WORLD_SIZE", {"RANK": "1", "LOCAL_RANK": "1"}, r"WORLD_SIZE"),
    ("WORLD_SIZE without LOCAL_RANK", {"RANK": "1", "WORLD_SIZE": "2"}, r"LOCAL_RANK"),
    ("bare PMIx has no size", {"PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-x-1@1"}, r"PMIX_RANK"),
]


@pytest.mark.parametrize("env,match", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_environments_raise(env, match):
    with pytest.raises(ValueError, match=match):
        detect_launcher(env)


@pytest.mark.parametrize("value,expected", [
    ("4", [4]),
    ("4(x2),3", [4, 4, 3]),
    ("2(x3),1,5(x1)", [2, 2, 2, 1, 5]),
    (" 16(x4) ", [16, 16, 16, 16]),
])
def test_parse_tasks_per_node(value, expected):
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "x", "4(x)", "4,,3", "4(2)", "-1"])
def test_parse_tasks_per_node_rejects(value):
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(value)


def test_describe_is_one_short_line():
    assert detect_launcher(SRUN_4_ON_2_NODES).describe() == \
        "slurm: rank 3/4, local 1/2, node 1/2, job 812345"
    assert detect_launcher({}).describe() == "single: rank 0/1, local 0/1, node 0/1"
    assert detect_launcher(HYDRA_4_PPN_2).describe() == "hydra: rank 2/4, local 0/2"
    for _, env, _ in RECORDED:
        line = detect_launcher(env).describe()
        assert "\n" not in line and len(line) < 120
