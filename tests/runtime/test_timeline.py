"""The timeline: phase spans, communication events and pipeline actions per rank, merged
into one Chrome trace (the end-to-end run under mpirun: test_timeline_run)."""

import json
from types import SimpleNamespace

import pytest

from hpctrain.runtime.timeline import Timeline, merge
from tests.mpirun import run_mpi


def _rank(tmp_path, rank, t0):
    tl = Timeline()
    tl.enable(str(tmp_path), rank)
    tl.phase("forward", t0)
    tl.phase("backward", t0 + 1.0)
    tl.op(SimpleNamespace(op="allreduce", group="dp[0,1]", seq=7, nbytes=4096,
                          dtype="float32", step=3, peer=None, start=t0 + 1.2, end=t0 + 1.5))
    tl.span("F mb0", "pipeline", t0 + 0.1, t0 + 0.4, stage=rank, chunk=0, micro_batch=0)
    tl.phase("optimizer", t0 + 2.0)
    tl.phase(None, t0 + 2.5)
    tl.write()
    assert not tl.enabled


def test_ranks_merge_into_one_trace(tmp_path):
    _rank(tmp_path, 0, 1000.0)
    _rank(tmp_path, 1, 1000.5)
    with open(merge(str(tmp_path), 2)) as fh:
        trace = json.load(fh)
    ev = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    spans = [e for e in ev if e["ph"] == "X"]
    for r in (0, 1):
        mine = {e["name"]: e for e in spans if e["pid"] == r}
        assert set(mine) == {"forward", "backward", "optimizer", "allreduce", "F mb0"}
        assert mine["forward"]["dur"] == 1e6 and mine["backward"]["dur"] == 1e6
        assert mine["optimizer"]["dur"] == 0.5e6
        comm = mine["allreduce"]
        assert comm["args"] == {"group": "dp[0,1]", "seq": 7, "bytes": 4096,
                                "dtype": "float32", "step": 3}
        assert comm["tid"] == 1 and mine["F mb0"]["tid"] == 2 and mine["forward"]["tid"] == 0
    # microseconds since the job's first event; rank 1 started 0.5 s later
    assert min(e["ts"] for e in spans) == 0
    first = {r: min(e["ts"] for e in spans if e["pid"] == r) for r in (0, 1)}
    assert first[1] - first[0] == 0.5e6


def test_a_phase_marked_twice_stays_one_span(tmp_path):
    tl = Timeline()
    tl.enable(str(tmp_path), 0)
    tl.phase("forward", 1.0)
    tl.phase("forward", 1.5)  # e.g. the trainer, then the strategy
    tl.phase(None, 2.0)
    assert [(e["name"], e["dur"]) for e in tl.events] == [("forward", 1e6)]


@pytest.mark.mpi
def test_a_pipeline_run_writes_one_merged_timeline(tmp_path):
    """--trace under mpirun: one row per rank with the trainer's phases (checkpoint
    included), every communication op with its bytes, and each pipeline action."""
    trace = tmp_path / "trace"
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--strategy", "pipeline", "--steps", "2",
                       "--progress", "off", "--out-dir", str(tmp_path / "out"),
                       "--checkpoint-dir", str(tmp_path / "ck"), "--trace", str(trace)],
                   timeout=180)
    assert f"hpctrain: timeline written: {trace}/trace.json" in proc.stdout, proc.stdout
    with open(trace / "trace.json") as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for r in (0, 1):
        mine = [e for e in spans if e["pid"] == r]
        phases = {e["name"] for e in mine if e["cat"] == "phases"}
        assert {"forward", "backward", "optimizer", "checkpoint"} <= phases, phases
        actions = [e for e in mine if e["cat"] == "pipeline"]
        # 4 micro-batches (pipeline.microbatches), a forward and a backward each, per step
        assert sorted(e["name"][0] for e in actions) == ["B"] * 8 + ["F"] * 8
        comm = [e for e in mine if e["cat"] == "comm"]
        p2p = [e for e in comm if e["name"] in ("isend", "irecv")]
        assert len(p2p) >= 16 and all(e["args"]["bytes"] > 0 for e in p2p)
        assert all(e["args"]["group"].startswith("pp") for e in p2p)
        assert any(e["name"] == "allreduce" for e in comm)
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
