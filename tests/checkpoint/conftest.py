"""One small trained GPT checkpoint (tied embeddings, AdamW at lr 0.003) shared by the tests."""

import pytest

from tests.mpirun import run_single

GPT_ARGS = ["-m", "hpctrain", "train", "--model", "gpt", "--strategy", "single", "--steps", "2",
            "--optimizer", "adamw", "--lr", "0.003", "--global-batch-size", "8",
            "--progress", "off", "--out-dir", ""]


@pytest.fixture(scope="session")
def gpt_ckpt(tmp_path_factory):
    """Path of ckpt-000002.h5 written by a 2-step single-process GPT run."""
    d = tmp_path_factory.mktemp("gpt") / "ck"
    run_single(GPT_ARGS + ["--checkpoint-dir", str(d)], timeout=240)
    return d / "ckpt-000002.h5"
