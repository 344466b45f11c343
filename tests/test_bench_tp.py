"""bench tp: the table at 2 ranks on a tiny gpt (the blocks' bytes equal Megatron's formula
exactly, the same computation as one rank and torch's tensor parallel), and its pieces on one
process. No timing assertions: only that every ratio is a finite positive number."""

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
        # outside the blocks: the vocab-parallel embedding's output (forward) and the head's
        # input (backward; under sequence parallel also its gather forward and the
        # embedding's backward), and the vocab-parallel cross-entropy's two all-reduces
        assert row["rest_ops"] == ({"allgather": 2, "reduce_scatter": 2, "allreduce": 2}
                                   if row["sp"] else {"allreduce": 4}), row
        # torch's whole step: the blocks' as ours, the embedding and head as ours, its
        # loss_parallel's 3 all-reduces; under sequence parallel one all-gather more (the
        # position embedding's gradient) and the LayerNorms' 2L+1 x 2 gradient all-reduces
        assert row["torch_ops"] == ({"all_gather_into_tensor": 4 * layers + 3,
                                     "reduce_scatter_tensor": 4 * layers + 2,
                                     "all_reduce": 4 * layers + 5} if row["sp"]
                                    else {"all_reduce": 4 * layers + 5}), row
        # the partial gradients of what ran on sequence chunks (6h per block: 2 LayerNorms,
        # 2 row-parallel biases; ln_f 2h; the position embedding s*h), summed over tp per
        # unit of the dp flavour (each block, the root), each with its 'got a gradient' flags
        assert row["sync_ops"] == ({"allreduce": 2 * (layers + 1)} if row["sp"] else {})
        assert row["sync_elements"] == ((6 * layers + 2 + seq) * d if row["sp"] else 0)
        for check in (row["check_before"], row["check_after"]):
            for name in ("ours", "torch"):
                assert abs(check[name] - check["single"]) < 1e-6, row
        assert row["check_before"]["ours_out"] < 1e-5 and row["check_before"]["torch_out"] < 1e-5
        assert row["check_after"]["single"] < row["check_before"]["single"]  # it trained
        assert row["torch_error"] == ""
        assert sorted(row["cpu_s"]) == ["ours", "single", "torch"]
        assert all(math.isfinite(v) and v > 0 for v in row["cpu_s"].values())
    assert "sp on: + the optimizer step's gradient sync" in out
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


def _fake_comm():
    """A size-2 Communicator whose collectives copy locally: the flight recorder logs it."""
    from hpctrain.runtime.comm.base import Communicator

    def nothing(self, *args):
        return None

    def gather(self, t, out):
        out.copy_(torch.cat([t, t]))

    def scatter(self, t, out, op):
        out.copy_(t[: out.shape[0]])

    hooks = {name: nothing for name in Communicator.__abstractmethods__}
    hooks.update(_allgather=gather, _reduce_scatter=scatter, backend="fake", rank=0, size=2,
                 device=torch.device("cpu"), name="faketp")
    return type("FakeComm", (Communicator,), hooks)()


def test_summary_of_recorded_ops():
    from hpctrain.bench.tensor import _recorded_since, summary
    from hpctrain.parallel.tensor.ops import gather_seq, reduce_from, reduce_scatter_seq
    from hpctrain.runtime.flight import RECORDER, group_key

    c = _fake_comm()
    c0 = RECORDER.count
    reduce_from(torch.randn(2, 4, 8), c)
    c1 = RECORDER.count
    y = gather_seq(torch.randn(2, 2, 8), c)
    reduce_scatter_seq(y, c)
    ops = _recorded_since(c0, group_key(c))
    assert [(i, e.op, e.nbytes) for i, e in ops] == [
        (c0 + 1, "allreduce", 256), (c0 + 2, "allgather", 128), (c0 + 3, "reduce_scatter", 256)]
    assert summary([e for i, e in ops if i <= c1], 2) == {"ops": {"allreduce": 1}, "bytes": 256,
                                                          "elements": 64}
    assert summary([e for i, e in ops if i > c1], 2) == {
        "ops": {"allgather": 1, "reduce_scatter": 1}, "bytes": 256, "elements": 128}


def test_interleave_qkv_gives_each_rank_whole_heads():
    from hpctrain.bench.tensor import interleave_qkv
    from hpctrain.models import registry

    model = registry.build("gpt", 0, d_model=32, heads=4, layers=2, n_samples=1).model
    before = [b.attn.qkv.weight.detach().clone() for b in model.blocks]
    interleave_qkv(model, 2)
    for b, w in zip(model.blocks, before):
        q, k, v = w.chunk(3)
        for r, rows in enumerate(b.attn.qkv.weight.detach().chunk(2)):  # ColwiseParallel's cut
            torch.testing.assert_close(rows, torch.cat([t.chunk(2)[r] for t in (q, k, v)]))


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
                "rest_bytes": 64, "rest_ops": {"allreduce": 2},
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
