"""Train under a per-rank memory cap (deferred-init test; run under mpirun).

``python capped_train_worker.py CAP_MB OUT_JSON [section.key=value ...]``: MPI starts, then
torch's meta-device code is loaded, RLIMIT_DATA (private writable memory: the heap and
anonymous mmaps, where every tensor lives) is set to this rank's current use + CAP_MB, then the Trainer builds the model and
trains. Rank 0 writes the losses to OUT_JSON; a refused allocation aborts the job. The cap is set after MPI and
torch started, so it caps what the model costs, not the libraries.
"""

import json
import resource
import sys

import torch


def _vm_data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def main() -> int:
    cap_mb, out = float(sys.argv[1]), sys.argv[2]
    from hpctrain.config import load_config, parse_assignment
    from hpctrain.runtime.world import init_world
    from hpctrain.train.training_run import TrainingRun

    torch.set_num_threads(1)
    cfg = load_config(None, [parse_assignment(a) for a in sys.argv[3:]])
    world = init_world(device="cpu")
    cfg.validate(world.size)
    # Load torch's meta-device machinery (about 70 MB of modules, imported on first use)
    # before the cap: library memory, the same for any model size.
    from hpctrain.models.registry import build_deferred

    build_deferred("gpt", 0, vocab=8, d_model=8, heads=2, layers=1, seq_len=4, n_samples=4)
    limit = _vm_data_bytes() + int(cap_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    # An allocation the cap refuses raises on that rank; hpctrain's abort handler ends the
    # whole job (MPI_Abort), so the test sees a non-zero exit and the message.
    summary = TrainingRun(cfg, world).fit()
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump({"cap_mb": cap_mb, "losses": summary["losses"]}, f)
    return 0


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
