"""Steps decided on the device (train/device_step.py): with a fused optimizer one process's
steps read nothing on the host inside a step, and train exactly as the synchronous step."""

import json

import numpy as np

from hpctrain import cli
from hpctrain.train.device_step import DeviceSteps

FUSED = ["--set", "train.optimizer_options.fused=true"]
ARGS = ["--model", "gpt", "--steps", "6", "--progress", "off", "--out-dir", "",
        "--max-grad-norm", "0.5", "--grad-accum", "2"]


def _train(tmp_path, name, flags):
    path = tmp_path / f"{name}.json"
    assert cli.main(["train", *ARGS, *flags, "--summary", str(path)]) == 0
    return json.loads(path.read_text())


def test_device_steps_match_the_synchronous_step(tmp_path, monkeypatch):
    launched = []
    launch = DeviceSteps.launch

    def counted(self, step, *rest):
        launched.append(step)
        return launch(self, step, *rest)

    monkeypatch.setattr(DeviceSteps, "launch", counted)
    dev = _train(tmp_path, "single", ["--strategy", "single"] + FUSED)
    assert launched == list(range(6))
    launched.clear()
    ref = _train(tmp_path, "zero1", ["--strategy", "zero1"] + FUSED)  # its own step: synchronous
    plain = _train(tmp_path, "unfused", ["--strategy", "single"])  # no found_inf: synchronous
    assert launched == []
    np.testing.assert_allclose(dev["losses"], ref["losses"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(dev["param_norm"], ref["param_norm"], rtol=1e-10)
    assert len(dev["losses"]) == len(plain["losses"]) == 6
    np.testing.assert_allclose(dev["losses"], plain["losses"], rtol=1e-4)  # fused vs foreach
