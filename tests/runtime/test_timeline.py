"""The timeline: phase spans, communication events and pipeline actions per rank, merged
into one Chrome trace (the end-to-end run under mpirun: test_timeline_run)."""

import json
from types import SimpleNamespace

from hpctrain.runtime.timeline import Timeline, merge


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
