"""The flight recorder's hot-path shortcuts keep what it records (no MPI)."""

import json
import mmap

import pytest
import torch

from hpctrain.runtime.comm import base
from hpctrain.runtime.comm.base import _recorded
from hpctrain.runtime.flight import MIRROR_SIZE, FlightRecorder, dtype_name, read_mirror
from hpctrain.runtime.timeline import Timeline


def test_dtypes_are_named_when_read(tmp_path):
    """start() keeps the torch.dtype it is given; entries, dumps and the timeline name it."""
    rec = FlightRecorder()
    a = rec.start("dp[0,1]", "allreduce", 64, torch.bfloat16)
    b = rec.start("dp[0,1]", "allgather", 8, "float32")  # a name passes through
    c = rec.start("dp[0,1]", "barrier")
    assert (a.dtype, b.dtype, c.dtype) == ("bfloat16", "float32", "")
    rec.end(a)
    rec.dump(str(tmp_path / "flight-rank-0.json"), rank=0)
    record = json.loads((tmp_path / "flight-rank-0.json").read_text())
    assert [e["dtype"] for e in record["entries"]] == ["bfloat16", "float32", ""]
    assert [e["dtype"] for e in record["pending"]] == ["float32", ""]
    assert set(record["entries"][0]) == set(a.FIELDS)  # the op's number is not a field
    tl = Timeline()
    tl.enable(str(tmp_path), 0)
    tl.op(a)
    assert tl.events[0]["args"]["dtype"] == "bfloat16"
    assert dtype_name(torch.int64) == "int64" and dtype_name(None) == ""


def test_the_oldest_pending_op_is_found_when_ops_complete_out_of_order():
    rec = FlightRecorder()
    a, b, c = (rec.start("dp[0,1]", op, 8, "float32") for op in ("iallgather", "iallreduce",
                                                                  "ireduce_scatter"))
    rec.end(b)
    assert rec.oldest_pending() is a
    rec.end(a)
    assert rec.oldest_pending() is c
    d = rec.start("pp[0,1]", "isend", 4, "float32", peer=1)
    rec.end(c)
    assert rec.oldest_pending() is d and list(rec.pending.values()) == [d]
    rec.end(d)
    assert rec.oldest_pending() is None


def test_the_mirror_keeps_the_last_op_pending_while_an_older_one_ends(tmp_path):
    path = tmp_path / "last-0.bin"
    path.write_bytes(b"\0" * MIRROR_SIZE)
    rec = FlightRecorder()
    with open(path, "r+b") as f:
        rec.set_mirror(mmap.mmap(f.fileno(), MIRROR_SIZE))
        try:
            a = rec.start("dp[0,1]", "iallgather", 8, torch.float32)
            b = rec.start("dp[0,1]", "allreduce", 8, torch.float32)
            rec.end(a)  # not the last op: the mirror still shows b, pending
            got = read_mirror(str(path))
            assert (got["op"], got["seq"], got["end"]) == ("allreduce", 2, None)
            rec.end(b)
            assert read_mirror(str(path))["end"] == b.end
        finally:
            rec.set_mirror(None)


class _Request:
    def __init__(self, done_after: int = 0, fail: bool = False):
        self.polls, self.done_after, self.fail, self.out = 0, done_after, fail, "the output"

    def test(self):
        self.polls += 1
        return self.polls > self.done_after

    def wait(self):
        if self.fail:
            raise RuntimeError("backend failure")
        return self.out


class _Comm:
    size = 2
    _flight_key = "dp[0,1]"
    _device_marker = None  # ops complete when the call returns (not NCCL)


@pytest.fixture
def recorder(monkeypatch):
    """A fresh recorder in place of the process's one, for the communicator wrappers."""
    rec = FlightRecorder()
    monkeypatch.setattr(base, "_RECORDER", rec)
    return rec


def test_a_recorded_request_ends_its_entry_once(recorder):
    """test() True ends the entry; a later wait() does not move its end; attributes pass
    through; a failing wait() still ends it."""
    iallreduce = _recorded("iallreduce", lambda self, t, op="sum": _Request(done_after=1), True)
    req = iallreduce(_Comm(), torch.ones(4, dtype=torch.float64))
    (e,) = recorder.pending.values()
    assert (e.op, e.nbytes, e.dtype, e.peer, e.seq) == ("iallreduce", 32, "float64", None, 1)
    assert req.test() is False and e.end is None
    assert req.test() is True and e.end is not None and not recorder.pending
    end = e.end
    assert req.wait() == "the output" and req.out == "the output" and e.end == end
    failing = iallreduce(_Comm(), torch.ones(2))
    failing._req.fail = True
    with pytest.raises(RuntimeError, match="backend failure"):
        failing.wait()
    assert not recorder.pending and recorder.ring[-1].end is not None


def test_the_wrapper_sizes_every_kind_of_op(recorder):
    comm = _Comm()
    _recorded("isend", lambda self, t, dest, tag=0: _Request(), True)(
        comm, torch.ones(3, dtype=torch.int32), 1).wait()
    _recorded("barrier", lambda self: None, False)(comm)
    _recorded("allreduce_scalars", lambda self, values, op="sum": values, False)(comm, [1.0, 2.0])
    _recorded("allgather", lambda self, tensor, out=None: tensor, False)(
        comm, tensor=torch.ones(2, dtype=torch.float16))
    got = [(e.op, e.nbytes, e.dtype, e.peer) for e in recorder.ring]
    assert got == [("isend", 12, "int32", 1), ("barrier", 0, "", None),
                   ("allreduce_scalars", 16, "float64", None), ("allgather", 4, "float16", None)]
    assert recorder.seqs == {"dp[0,1]:p2p": 1, "dp[0,1]": 3} and not recorder.pending
