"""Device choice and CPU thread sizing."""

import pytest
import torch

from hpctrain.errors import UsageError
from hpctrain.runtime.device import available_cpus, bind_device, cpu_threads, select_device


@pytest.mark.parametrize("env,local_size,cpu_count,expected", [
    ({}, 4, 16, 4),                                               # even split of the node
    ({}, 3, 16, 5),                                               # rounds down
    ({}, 32, 16, 1),                                              # never below one
    ({}, 1, 0, 1),                                                # unknown CPU count
    ({"SLURM_CPUS_PER_TASK": "8"}, 4, 128, 8),                    # what Slurm granted
    ({"OMP_NUM_THREADS": "2"}, 1, 16, 2),                         # explicit user choice
    ({"SLURM_CPUS_PER_TASK": "6", "OMP_NUM_THREADS": "2"}, 2, 64, 6),
    ({"OMP_NUM_THREADS": "4,2"}, 1, 16, 4),                       # nested-levels form
    ({"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": " "}, 2, 8, 4),  # exported empty = unset
])
def test_cpu_threads(env, local_size, cpu_count, expected):
    assert cpu_threads(env, local_size, cpu_count) == expected


@pytest.mark.parametrize("env,local_size,match", [
    ({"SLURM_CPUS_PER_TASK": "abc"}, 1, "SLURM_CPUS_PER_TASK='abc'"),
    ({"OMP_NUM_THREADS": "0"}, 1, "OMP_NUM_THREADS='0'"),
    ({"OMP_NUM_THREADS": "many"}, 1, "OMP_NUM_THREADS='many'"),
    ({}, 0, "local_size=0"),
])
def test_cpu_threads_rejects(env, local_size, match):
    with pytest.raises(ValueError, match=match):
        cpu_threads(env, local_size, 16)


@pytest.mark.parametrize("local_rank,env,count,expected", [
    (0, {}, 0, "cpu"),                                            # no GPU
    (3, {}, 4, "cuda:3"),                                         # one GPU per local rank
    (5, {}, 4, "cuda:1"),                                         # more ranks than GPUs: share
    (2, {"CUDA_VISIBLE_DEVICES": "2"}, 1, "cuda:0"),              # srun --gpus-per-task=1
    (2, {"CUDA_VISIBLE_DEVICES": "2"}, 4, "cuda:0"),              # ... even if all were counted
    (3, {"CUDA_VISIBLE_DEVICES": "0,1"}, 2, "cuda:1"),            # two visible, shared
    (1, {"HPCTRAIN_DEVICE": "cpu"}, 4, "cpu"),                    # forced CPU on a GPU node
    (1, {"HPCTRAIN_DEVICE": "CUDA"}, 2, "cuda:1"),                # forced, case-insensitive
    (1, {"HPCTRAIN_DEVICE": "auto"}, 0, "cpu"),
    (1, {"HPCTRAIN_DEVICE": ""}, 2, "cuda:1"),
])
def test_select_device(local_rank, env, count, expected):
    assert select_device(local_rank, env, count) == expected


def test_select_device_forced_cuda_without_gpu_names_the_fix():
    with pytest.raises(ValueError, match="HPCTRAIN_DEVICE='cuda'") as err:
        select_device(0, {"HPCTRAIN_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}, 0)
    assert "fix:" in str(err.value) and "HPCTRAIN_DEVICE=cpu" in str(err.value)


def test_requested_device_wins_and_is_the_one_blamed():
    assert select_device(1, {"HPCTRAIN_DEVICE": "cuda"}, 2, requested="cpu") == "cpu"
    with pytest.raises(UsageError, match=r"runtime.device = 'cuda' \(--device\)") as err:
        select_device(0, {}, 0, requested="cuda")
    assert "HPCTRAIN_DEVICE=" not in str(err.value).split(";")[0]


@pytest.mark.parametrize("local_rank,env,count,match", [
    (0, {"HPCTRAIN_DEVICE": "gpu"}, 2, "HPCTRAIN_DEVICE='gpu'"),
    (-1, {}, 2, "local_rank=-1"),
])
def test_select_device_rejects(local_rank, env, count, match):
    with pytest.raises(ValueError, match=match):
        select_device(local_rank, env, count)


def test_available_cpus_is_positive():
    assert available_cpus() >= 1


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bind_device_cpu_sets_threads(restore_threads):
    device = bind_device(0, 1, {"HPCTRAIN_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
    assert device == torch.device("cpu")
    assert torch.get_num_threads() == 1


def test_bind_device_cpu_splits_cores(restore_threads):
    device = bind_device(1, 64, {"HPCTRAIN_DEVICE": "cpu"})
    assert device.type == "cpu"
    assert torch.get_num_threads() == max(1, available_cpus() // 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bind_device_gpu_sets_current_device():
    count = torch.cuda.device_count()
    device = bind_device(count - 1, count, {})
    assert device == torch.device(f"cuda:{count - 1}")
    assert torch.cuda.current_device() == count - 1
