"""Validation (``Trainer.validate``, and ``val_every`` during fit) gives one process's value
under every plan family: the pipeline's forward-only schedule (pp x dp zero3, interleaved
chunks), tensor parallel with sequence parallel over tp x dp, the domain split over dom x dp
zero3, and fsdp; and a user's convolutional model and DataLoaders through ``fit`` under dom x dp
(validation during fit and after). The held-out set's last batch is short, so some ranks' parts and some
pipeline pieces are partly or wholly empty (padded pieces count only their real rows)."""

import pytest
import torch

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

WORKER = "tests/train/validate_plans_worker.py"
FOUR = ["pipeline-zero3", "tensor-dp", "domain-dp", "domain-fit"]
TWO = ["pipeline-interleaved", "fsdp"]


def _step(tmp, tag, world, cases):
    """``WORKER OUT CASE...`` in the session's launches (tests/parallel/train_cases.py)."""
    return script_step(tmp, tag, world, WORKER, [], ["{out}", *cases])


pool(__name__, lambda tmp: [_step(tmp, "single", None, [f"single:{c}" for c in FOUR + TWO]),
                            _step(tmp, "two", 2, TWO), _step(tmp, "four", 4, FOUR)], "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {tag: script_output(res, tag) for tag in ("single", "two", "four")}


@pytest.mark.mpi
def test_validation_matches_one_process_under_every_plan(runs):
    want, got = runs["single"], {**runs["four"], **runs["two"]}
    for case in FOUR + TWO:
        (losses, val), (want_losses, want_val) = got[case], want[f"single:{case}"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5,
                                   atol=0, msg=case)
        assert val == pytest.approx(want_val, rel=1e-5), case
