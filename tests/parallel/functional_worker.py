"""Under mpirun: differentiable collectives are exact adjoints; SyncBatchNorm = BatchNorm on the full batch."""

import torch
from torch import nn

from hpctrain.parallel.functional import all_reduce_sum
from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
from hpctrain.runtime.world import init_world
from tests.adjoint import check_adjoint

torch.manual_seed(0)
world = init_world()
comm = world.comm
check_adjoint(lambda x: all_reduce_sum(x, comm), (5, 3), (5, 3), comm)

# Full batch of 11 (does not split evenly), channels 3, spatial 5x4; each rank owns a slice.
full = torch.randn(11, 3, 5, 4, dtype=torch.float64) * 3 + 1
gout = torch.randn(11, 3, 5, 4, dtype=torch.float64)
ref = nn.BatchNorm2d(3).double()
with torch.no_grad():
    ref.weight.uniform_(0.5, 1.5)
    ref.bias.uniform_(-0.5, 0.5)
sync = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)).double(), comm)[0]
sync.load_state_dict(ref.state_dict())

xr = full.clone().requires_grad_(True)
ref(xr).backward(gout)
mine = torch.tensor_split(torch.arange(11), comm.size)[comm.rank]
xs = full[mine].clone().requires_grad_(True)
sync(xs).backward(gout[mine])

torch.testing.assert_close(xs.grad, xr.grad[mine], rtol=1e-10, atol=1e-12)
for name in ("weight", "bias"):
    g = comm.allreduce(getattr(sync, name).grad.clone())
    torch.testing.assert_close(g, getattr(ref, name).grad, rtol=1e-10, atol=1e-12)
for name in ("running_mean", "running_var", "num_batches_tracked"):
    torch.testing.assert_close(getattr(sync, name), getattr(ref, name), rtol=1e-10, atol=1e-12)
sync.eval(), ref.eval()
torch.testing.assert_close(sync(full[mine]), ref(full)[mine], rtol=1e-10, atol=1e-12)
print("functional ok", comm.rank)
