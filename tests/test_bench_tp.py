"""bench tp: the table at 2 ranks on a tiny stack (bytes equal Megatron's formula exactly,
the same computation as one rank and torch's tensor parallel), and its pieces on one process.
No timing assertions: only that every ratio is a finite positive number."""

import json
import math
import re

import pytest
import torch

from tests.mpirun import run_mpi

_ROW = re.compile(r"^ +(\d+) +(off|on) +([\d.]+) +([\d.]+|-) +([\d.]+) +([\d.]+|-) +"
                  r"(PASS \(<= 1\.00\)|MISS \(<= 1\.00\)|no torch run) +([\d.]+) +(\d+) +(\d+) +"
                  r"([\d.]+)$")


def _rows(out: str) -> list:
    return [m.groups() for m in map(_ROW.match, out.splitlines()) if m]


@pytest.mark.mpi
def test_bench_tp_table_bytes_and_check(tmp_path):
    layers, d, heads, seq, batch, tp = 2, 32, 2, 8, 2, 2
    path = tmp_path / "tp.json"
    proc = run_mpi(tp, ["-m", "hpctrain", "bench", "tp", "--layers", str(layers), "--d-model",
                        str(d), "--heads", str(heads), "--seq-len", str(seq), "--batch",
                        str(batch), "--steps", "2", "--warmup", "1", "--json", str(path)],
                   timeout=240)
    out = proc.stdout
    assert out.startswith("tp bench: 2 x GPTBlock(d_model 32, 2 heads"), out
    rows = _rows(out)
    assert [(r[0], r[1]) for r in rows] == [("2", "off"), ("2", "on")], out
    per_block = 8 * (tp - 1) * batch * seq * d * 4 // tp  # Megatron, per rank, ring
    for r in rows:
        ours, torch_ms, single, ratio = float(r[2]), float(r[3]), float(r[4]), float(r[5])
        assert all(math.isfinite(v) and v > 0 for v in (ours, torch_ms, single, ratio)), out
        assert r[6] == ("PASS (<= 1.00)" if ratio <= 1.0 else "MISS (<= 1.00)"), out
        assert math.isfinite(float(r[7])) and float(r[7]) > 0, out
        assert int(r[8]) == int(r[9]) == layers * per_block and r[10] == "1.000", out
    data = json.loads(path.read_text())
    assert data["ranks"] == tp and data["target"] == 1.0 and len(data["rows"]) == 2
    for row in data["rows"]:
        assert row["measured_bytes"] == row["formula_bytes"] == layers * per_block
        assert row["measured_ops"] == row["formula_ops"] == (
            {"allgather": 4 * layers, "reduce_scatter": 4 * layers} if row["sp"]
            else {"allreduce": 4 * layers})
        # torch's tensor parallel moves the same collectives (and, under sequence parallel,
        # all-reduces the LayerNorms' partial gradients in its optimizer step)
        assert row["torch_ops"] == ({"all_gather_into_tensor": 4 * layers,
                                     "reduce_scatter_tensor": 4 * layers,
                                     "all_reduce": 4 * layers} if row["sp"]
                                    else {"all_reduce": 4 * layers}), row
        assert row["sync_ops"] == ({"allreduce": 1} if row["sp"] else {})
        assert row["sync_elements"] == (6 * d * layers if row["sp"] else 0)
        for check in (row["check_before"], row["check_after"]):
            for name in ("ours", "torch"):
                assert abs(check[name] - check["single"]) < 1e-6, row
        assert row["check_before"]["ours_out"] < 1e-5 and row["check_before"]["torch_out"] < 1e-5
        assert row["check_after"]["single"] < row["check_before"]["single"]  # it trained
        assert row["torch_error"] == ""
        assert sorted(row["cpu_s"]) == ["ours", "single", "torch"]
        assert all(math.isfinite(v) and v > 0 for v in row["cpu_s"].values())
    assert "sp on: + gradient all-reduce of the sequence-parallel parameters" in out
    assert out.count(": cpu ms/step (process time") == 2, out


def test_formula_and_ring_bytes():
    from hpctrain.bench.tensor import formula_bytes, ring_bytes

    assert ring_bytes("allreduce", 1024, 2) == 1024
    assert ring_bytes("allreduce", 1024, 4) == 1536
    assert ring_bytes("allgather", 1024, 4) == ring_bytes("reduce_scatter", 1024, 4) == 768
    n = 4 * 256 * 512 * 4
    for tp in (2, 4):
        off, on = (formula_bytes(3, 4, 256, 512, tp, sp) for sp in (False, True))
        assert off["ops"] == {"allreduce": 12}
        assert on["ops"] == {"allgather": 12, "reduce_scatter": 12}
        assert off["bytes"] == on["bytes"] == 3 * 8 * (tp - 1) * n // tp


class _FakeComm:
    rank, size = 0, 2

    def allreduce(self, t, op="sum"):
        return t

    def allgather(self, t, out=None):
        return torch.cat([t, t])

    def reduce_scatter(self, t, out=None, op="sum"):
        return t[: t.shape[0] // 2].clone()


def test_counting_comm_logs_ops_and_bytes():
    from hpctrain.bench.tensor import CountingComm, _summary
    from hpctrain.parallel.tensor.ops import gather_seq, reduce_from, reduce_scatter_seq

    c = CountingComm(_FakeComm())
    x = torch.randn(2, 4, 8)
    reduce_from(x, c)
    c.tag = "other"
    y = gather_seq(torch.randn(2, 2, 8), c)
    reduce_scatter_seq(y, c)
    assert c.log == [("act", "allreduce", 256), ("other", "allgather", 256),
                     ("other", "reduce_scatter", 256)]
    assert c.size == 2 and c.rank == 0  # everything else goes to the wrapped communicator
    assert _summary(c.log, "act", 2) == {"ops": {"allreduce": 1}, "bytes": 256}
    assert _summary(c.log, "other", 2) == {"ops": {"allgather": 1, "reduce_scatter": 1},
                                           "bytes": 256}


def test_torch_block_computes_the_gpt_block():
    from hpctrain.bench.tensor import BlockStack, TorchBlock, TorchStack

    torch.manual_seed(0)
    ours = BlockStack(2, 32, 4)
    theirs = TorchStack([TorchBlock.from_gpt(b) for b in ours.blocks])
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(theirs(x), ours(x), rtol=1e-5, atol=1e-6)


def test_report_verdicts_and_missing_torch():
    from hpctrain.bench.tensor import report

    def row(sp, ours, torch_s=None, err=""):
        med = {"ours": ours, "single": 0.2, **({"torch": torch_s} if torch_s else {})}
        check = {"single": 1.0, "ours": 1.0, "ours_out": 0.0,
                 **({"torch": 1.0, "torch_out": 0.0} if torch_s else {})}
        return {"tp": 2, "sp": sp, "median_s": med, "step_s": {k: [v] for k, v in med.items()},
                "cpu_s": med,
                "measured_bytes": 2048, "formula_bytes": 2048,
                "measured_ops": {"allreduce": 4}, "formula_ops": {"allreduce": 4},
                "sync_bytes": 0, "sync_ops": {}, "sync_elements": 0, "torch_ops": {},
                "torch_error": err, "check_before": check, "check_after": check,
                "sgd_steps": 3}

    header = {"layers": 1, "d_model": 32, "heads": 2, "seq_len": 8, "batch": 2, "steps": 1,
              "warmup": 0, "ranks": 2, "load0": 0.0, "load1": 0.0, "shared": ""}
    lines = report([row(False, 0.1, 0.1), row(True, 0.3, 0.2),
                    row(True, 0.1, None, "RuntimeError: no gloo")], header)
    rows = _rows("\n".join(lines))
    assert [r[6] for r in rows] == ["PASS (<= 1.00)", "MISS (<= 1.00)", "no torch run"]
    assert rows[1][5] == "1.50" and rows[2][3] == rows[2][5] == "-"
    assert "  sp on: torch TP did not run: RuntimeError: no gloo" in lines


def test_bench_tp_options():
    from hpctrain.cli import build_parser

    parse = build_parser().parse_args
    a = parse(["bench", "tp"])
    assert (a.layers, a.d_model, a.heads, a.seq_len, a.batch, a.steps, a.warmup,
            a.sequence_parallel, a.no_torch) == (4, 512, 8, 256, 4, 5, 2, "both", False)
    a = parse(["bench", "tp", "--sequence-parallel", "on", "--d-model", "64", "--no-torch"])
    assert a.sequence_parallel == "on" and a.d_model == 64 and a.no_torch
    with pytest.raises(SystemExit):
        parse(["bench", "tp", "--sequence-parallel", "maybe"])
