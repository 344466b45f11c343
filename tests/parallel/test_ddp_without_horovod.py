"""Without Horovod (GPU images often lack it) the ddp flavour runs on the engine's all-reduce,
says so on rank 0, and still trains exactly as one process does."""

import json

import numpy as np

from hpctrain import cli
from hpctrain.parallel import orchestrator

ARGS = ["--model", "mlp", "--steps", "4", "--progress", "off", "--out-dir", ""]


def _train(tmp_path, name, flags):
    path = tmp_path / f"{name}.json"
    assert cli.main(["train", *ARGS, *flags, "--summary", str(path)]) == 0
    return json.loads(path.read_text())


def test_ddp_without_horovod_is_the_engine_all_reduce_and_says_so(tmp_path, monkeypatch, capsys):
    ref = _train(tmp_path, "single", ["--strategy", "single"])
    monkeypatch.setattr(orchestrator, "_HOROVOD", False)
    got = _train(tmp_path, "ddp", ["--strategy", "ddp"])
    out = capsys.readouterr().out
    assert "Horovod is not installed: the ddp flavour runs on hpctrain's own all-reduce" in out
    assert got["strategy"] == "ddp"
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6, atol=0)
    # fp16 compression is Horovod's: refused, not silently dropped
    code = cli.main(["train", *ARGS, "--strategy", "ddp", "--fp16-compression"])
    assert code != 0 and "fp16_compression needs Horovod" in capsys.readouterr().err
