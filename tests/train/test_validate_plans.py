"""Validation (``Trainer.validate``, and ``val_every`` during fit) gives one process's value
under every plan family: the pipeline's forward-only schedule (pp x dp zero3, interleaved
chunks), tensor parallel with sequence parallel over tp x dp, the domain split over dom x dp
zero3, and fsdp; and a user's convolutional model and DataLoaders through ``fit`` under dom x dp
(validation during fit and after). The held-out set's last batch is short, so some ranks' parts and some
pipeline pieces are partly or wholly empty (padded pieces count only their real rows)."""

import pytest
import torch

from tests.mpirun import run_worker_json

WORKER = "tests/train/validate_plans_worker.py"
FOUR = ["pipeline-zero3", "tensor-dp", "domain-dp", "domain-fit"]
TWO = ["pipeline-interleaved", "fsdp"]


def _run(tmp_path, name, ranks, cases):
    return run_worker_json(WORKER, tmp_path / f"{name}.json", ranks, cases)


@pytest.mark.mpi
def test_validation_matches_one_process_under_every_plan(tmp_path):
    want = _run(tmp_path, "single", 1, [f"single:{c}" for c in FOUR + TWO])
    got = {**_run(tmp_path, "four", 4, FOUR), **_run(tmp_path, "two", 2, TWO)}
    for case in FOUR + TWO:
        (losses, val), (want_losses, want_val) = got[case], want[f"single:{case}"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5,
                                   atol=0, msg=case)
        assert val == pytest.approx(want_val, rel=1e-5), case
