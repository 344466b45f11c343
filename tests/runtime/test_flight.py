"""The flight recorder's hot-path shortcuts keep what it records (no MPI)."""

import gc
import json
import mmap
import sys
import tracemalloc
from types import SimpleNamespace

import pytest
import torch

from hpctrain.runtime import flight
from hpctrain.runtime.abort import _context, set_context
from hpctrain.runtime.comm import Request, base, recording
from hpctrain.runtime.comm.recording import _recorded
from hpctrain.runtime.flight import (MIRROR_SIZE, NAME_SLOTS, FlightRecorder, dtype_name,
                                     read_mirror)
from hpctrain.runtime.timeline import TIMELINE, Timeline

@pytest.fixture
def recorder(monkeypatch):
    """A fresh recorder in place of the process's one, for the wrappers."""
    rec = FlightRecorder()
    monkeypatch.setattr(recording, "_RECORDER", rec)
    return rec


@pytest.fixture
def context():
    """abort._context, restored afterwards."""
    saved = dict(_context)
    yield _context
    _context.clear()
    _context.update(saved)


@pytest.fixture
def mirror_file(tmp_path):
    """(path, open mmap) of an empty mirror file; closed afterwards."""
    path = tmp_path / "last-0.bin"
    path.write_bytes(b"\0" * MIRROR_SIZE)
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), MIRROR_SIZE)
    yield str(path), m
    m.close()


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


def test_an_entry_reads_as_a_list_with_named_fields():
    rec = FlightRecorder()
    e = rec.start(key="pp[0,1]", op="isend", nbytes=4, dtype="float32", peer=1)
    assert len(e) == 11 and e[9] is None and e[10] == 1 == rec.count
    assert (e.seq, e.op, e.group, e.nbytes, e.peer, e.step, e.phase) == (
        1, "isend", "pp[0,1]", 4, 1, None, None)
    assert list(e)[:5] == [1, "isend", "pp[0,1]", 4, "float32"] and e[-1] == 1
    assert e.start == e[8] and isinstance(e.start, float)
    e.end = 5.0
    assert e[9] == 5.0
    e[9] = None
    assert e.end is None
    with pytest.raises(IndexError):
        e[11]
    assert rec.seqs == {"pp[0,1]:p2p": 1}


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


def test_the_mirror_keeps_the_last_op_pending_while_an_older_one_ends(mirror_file):
    path, m = mirror_file
    rec = FlightRecorder()
    rec.set_mirror(m)
    try:
        a = rec.start("dp[0,1]", "iallgather", 8, torch.float32)
        b = rec.start("dp[0,1]", "allreduce", 8, torch.float32)
        rec.end(a)  # not the last op: the mirror still shows b, pending
        got = read_mirror(path)
        assert (got["op"], got["seq"], got["end"]) == ("allreduce", 2, None)
        rec.end(b)
        assert read_mirror(path)["end"] == b.end
    finally:
        rec.set_mirror(None)
    assert rec.mirror is None  # released: the mmap can be closed


def test_a_new_mirror_gets_the_names_again(tmp_path, context):
    """Names are written into each mirror's table once: a new mirror (a restarted watchdog)
    starts its own table, and a phase change is a new row."""
    rec = FlightRecorder()
    for n in range(2):
        path = tmp_path / f"last-{n}.bin"
        path.write_bytes(b"\0" * MIRROR_SIZE)
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), MIRROR_SIZE)
            rec.set_mirror(m)
            for phase in ("forward", "backward", "forward"):
                set_context(phase=phase)
                rec.end(rec.start("dp[0,1]", "allreduce", 8, "float32"))
                got = read_mirror(str(path))
                assert (got["op"], got["group"], got["phase"]) == ("allreduce", "dp[0,1]", phase)
            rec.set_mirror(None)
            m.close()
        raw = path.read_bytes()
        assert raw[48:48 + 88 * 2] and raw[48 + 88 * 2:48 + 88 * 3] == b"\0" * 88  # two rows


LONG_OP = "reduce_scatter_long_nam" + "é" + "_and_more"  # cut inside the é: 24 bytes


def test_the_mirror_cuts_long_names_and_reads_back_when_its_table_is_full(context, tmp_path):
    """Names longer than their field are cut (inside a character too), a bool is no step, and
    once the table is full the names read '?' while the numbers go on."""
    path = tmp_path / "last-0.bin"
    path.write_bytes(b"\0" * MIRROR_SIZE)
    rec = FlightRecorder()
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), MIRROR_SIZE)
        rec.set_mirror(m)
        set_context(step=7, phase="backward")
        rec.end(rec.start("dp[0,1]", "allreduce", 8, "float32"))
        long_key = "a-group-name-longer-than-the-table-field-of-48-bytes[0,1,2,3]"
        e = rec.start(long_key, LONG_OP, 8, "float32")
        pending = read_mirror(str(path))
        rec.end(e)
        set_context(step=True, phase="optimizer-and-then-some")  # a bool is no step
        rec.end(rec.start("pp[0,1]", "isend", 4, "float32", peer=1))
        mid = read_mirror(str(path))
        set_context(step=None, phase=None)
        for i in range(NAME_SLOTS + 2):  # the table fills up: the names read '?'
            rec.end(rec.start(f"g{i}[0,1]", "barrier"))
        rec.set_mirror(None)
        m.close()
    last = read_mirror(str(path))
    assert (pending["op"], pending["group"], pending["phase"], pending["step"],
            pending["end"]) == ("reduce_scatter_long_nam\ufffd", long_key[:48], "backward",
                                7, None)
    assert (mid["op"], mid["seq"], mid["step"], mid["phase"]) == (
        "isend", 1, None, "optimizer-and-th")
    assert (last["op"], last["group"], last["count"], last["seq"]) == (
        "?", "?", NAME_SLOTS + 5, 1)
    assert last["end"] is not None


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


def test_a_recorded_request_ends_its_entry_once(recorder):
    """test() True ends the entry; a later wait() does not move its end; attributes pass
    through; a failing wait() still ends it."""
    iallreduce = _recorded("iallreduce", lambda self, t, op="sum": _Request(done_after=1),
                               True)
    req = iallreduce(_Comm(), torch.ones(4, dtype=torch.float64))
    assert isinstance(req, Request)
    (e,) = recorder.pending.values()
    assert (e.op, e.nbytes, e.dtype, e.peer, e.seq) == ("iallreduce", 32, "float64", None, 1)
    assert req.test() is False and e.end is None
    assert req.test() is True and e.end is not None and not recorder.pending
    end = e.end
    assert req.wait() == "the output" and req.out == "the output" and e.end == end
    assert req.test() is True and e.end == end
    failing = iallreduce(_Comm(), torch.ones(2))
    failing._req.fail = True
    with pytest.raises(RuntimeError, match="backend failure"):
        failing.wait()
    assert not recorder.pending and recorder.ring[-1].end is not None
    with pytest.raises(AttributeError):
        req.no_such_attribute


def test_requests_end_once_each_on_the_timeline(recorder, monkeypatch):
    """The TIMELINE gets each finished op once (when --trace is on), none when off."""
    spans = []
    monkeypatch.setattr(TIMELINE, "op", spans.append)
    monkeypatch.setattr(TIMELINE, "enabled", True)
    irecv = _recorded("irecv", lambda self, t, source, tag=0: _Request(), True)
    barrier = _recorded("barrier", lambda self: None, False)
    reqs = [irecv(_Comm(), torch.ones(2), source=1) for _ in range(3)]
    barrier(_Comm())
    reqs[1].test()
    reqs[1].wait()
    reqs[0].wait()
    reqs[0].wait()
    reqs[2].test()
    assert [e.op for e in spans] == ["barrier", "irecv", "irecv", "irecv"]
    assert [e.seq for e in spans] == [1, 2, 1, 3] and not recorder.pending
    monkeypatch.setattr(TIMELINE, "enabled", False)
    barrier(_Comm())
    assert len(spans) == 4


def test_the_wrapper_sizes_every_kind_of_op(recorder):
    comm = _Comm()
    _recorded("isend", lambda self, t, dest, tag=0: _Request(), True)(
        comm, torch.ones(3, dtype=torch.int32), 1).wait()
    _recorded("barrier", lambda self: None, False)(comm)
    _recorded("allreduce_scalars", lambda self, values, op="sum": values, False)(
        comm, [1.0, 2.0])
    _recorded("allgather", lambda self, tensor, out=None: tensor, False)(
        comm, tensor=torch.ones(2, dtype=torch.float16))
    got = [(e.op, e.nbytes, e.dtype, e.peer) for e in recorder.ring]
    assert got == [("isend", 12, "int32", 1), ("barrier", 0, "", None),
                   ("allreduce_scalars", 16, "float64", None), ("allgather", 4, "float16", None)]
    assert recorder.seqs == {"dp[0,1]:p2p": 1, "dp[0,1]": 3} and not recorder.pending


def test_the_wrapper_sizes_as_the_python_sizing_functions(recorder):
    """Keyword and positional forms, p2p_group through its Python sizing function, arguments
    without a size."""
    comm = _Comm()
    t8 = torch.ones(2, dtype=torch.float32)
    sends = [(torch.ones(3, dtype=torch.int64), 3, 0), (t8, 1, 0)]
    recvs = [(torch.ones(1, dtype=torch.int64), 2, 0)]
    calls = [
        ("send", lambda self, tensor, dest, tag=0: None, False, (), {"tensor": t8, "dest": 3}),
        ("recv", lambda self, tensor, source, tag=0: None, False, (t8,), {"source": 2}),
        ("recv", lambda self, tensor=None, source=None: None, False, (), {}),
        ("isend_boxes", lambda self, t, boxes, dest: _Request(), True, (t8, [], 5), {}),
        ("irecv_boxes", lambda self, t, boxes, source: _Request(), True, (t8, []),
         {"source": 4}),
        ("p2p_group", lambda self, sends, recvs: _Request(), True, (sends,), {"recvs": recvs}),
        ("p2p_group", lambda self, sends=(), recvs=(): _Request(), True, (), {}),
        ("allreduce_scalars", lambda self, values, op="sum": None, False, (),
         {"values": (1.0, 2.0, 3.0)}),
        ("allreduce", lambda self, tensor, op="sum": None, False, ("not a tensor",), {}),
        ("allreduce", lambda self, tensor=None: None, False, (), {}),
        ("broadcast", lambda self, tensor, root=0: None, False, (), {"tensor": t8, "root": 1}),
    ]
    for name, fn, nb, args, kwargs in calls:
        res = _recorded(name, fn, nb)(comm, *args, **kwargs)
        if nb:
            res.wait()
    got = [(e.op, e.nbytes, e.dtype, e.peer) for e in recorder.ring]
    assert got == [("send", 8, "float32", 3), ("recv", 8, "float32", 2), ("recv", 0, "", None),
                   ("isend_boxes", 8, "float32", 5), ("irecv_boxes", 8, "float32", 4),
                   ("p2p_group", 40, "int64", [1, 2, 3]), ("p2p_group", 0, "", None),
                   ("allreduce_scalars", 24, "float64", None), ("allreduce", 0, "", None),
                   ("allreduce", 0, "", None), ("broadcast", 8, "float32", None)]


def test_sequence_numbers_count_per_group_with_point_to_point_apart(recorder, context):
    """Collectives and p2p ops of one group are numbered apart; a communicator without a
    cached key gets group_key's (and keeps it); step and phase come from the context."""
    dp, pp = _Comm(), _Comm()
    pp._flight_key = "pp[0,2]"
    world = SimpleNamespace(size=4, _flight_key=None, name="world",
                            world_ranks=lambda: [0, 1, 2, 3])
    allreduce = _recorded("allreduce", lambda self, tensor, op="sum": tensor, False)
    send = _recorded("send", lambda self, tensor, dest, tag=0: None, False)
    irecv = _recorded("irecv", lambda self, tensor, source, tag=0: _Request(), True)
    t = torch.ones(1)
    set_context(step=3, phase="forward")
    allreduce(dp, t)
    send(dp, t, 1)
    allreduce(pp, t)
    set_context(step=4, phase="backward")
    req = irecv(dp, t, 1)
    allreduce(dp, t)
    allreduce(world, t)
    allreduce(world, t)
    req.wait()
    got = [(e.op, e.group, e.seq, e.step, e.phase) for e in recorder.ring]
    assert got == [("allreduce", "dp[0,1]", 1, 3, "forward"),
                   ("send", "dp[0,1]", 1, 3, "forward"),
                   ("allreduce", "pp[0,2]", 1, 3, "forward"),
                   ("irecv", "dp[0,1]", 2, 4, "backward"),
                   ("allreduce", "dp[0,1]", 2, 4, "backward"),
                   ("allreduce", "world[0-3]", 1, 4, "backward"),
                   ("allreduce", "world[0-3]", 2, 4, "backward")]
    assert recorder.seqs == {"dp[0,1]": 2, "dp[0,1]:p2p": 2, "pp[0,2]": 1, "world[0-3]": 2}
    assert world._flight_key == "world[0-3]" and recorder.count == 7
    assert [e[10] for e in recorder.ring] == list(range(1, 8))


def test_pending_ops_stay_in_start_order(recorder):
    ops = [_recorded(n, lambda self, tensor: _Request(), True)
           for n in ("iallgather", "iallreduce", "ireduce_scatter")]
    reqs = [op(_Comm(), torch.ones(1)) for op in ops]
    assert [e.op for e in recorder.pending.values()] == ["iallgather", "iallreduce",
                                                         "ireduce_scatter"]
    reqs[1].wait()
    assert list(recorder.pending) == [1, 3] and recorder.oldest_pending().op == "iallgather"
    reqs[0].test()
    reqs[2].wait()
    assert not recorder.pending and recorder.oldest_pending() is None


def test_an_exception_in_the_op_ends_its_entry_and_propagates(recorder):
    def fail(self, tensor):
        raise ValueError("bad op")

    with pytest.raises(ValueError, match="bad op") as info:
        _recorded("allreduce", fail, False)(_Comm(), torch.ones(1))
    assert info.traceback[-1].name == "fail"  # the op's own traceback is kept
    with pytest.raises(KeyboardInterrupt):
        _recorded("iallreduce", lambda self, t: (_ for _ in ()).throw(KeyboardInterrupt),
                      True)(_Comm(), torch.ones(1))
    assert [e.end is not None for e in recorder.ring] == [True, True] and not recorder.pending


def test_an_exception_while_sizing_runs_no_op_and_records_nothing(recorder):
    class Broken:
        @property
        def nbytes(self):
            raise RuntimeError("sizing failed")

    ran = []
    with pytest.raises(RuntimeError, match="sizing failed"):
        _recorded("allreduce", lambda self, t: ran.append(t), False)(_Comm(), Broken())
    assert not ran and not recorder.ring and not recorder.pending and recorder.count == 0


def test_a_device_marker_ends_completed_ops_on_the_device(monkeypatch):
    """With comm._device_marker, a returned op or a waited request is handed to
    end_on_device(entry, marker()) once and stays pending until the marker completes; a
    test() True (complete on the device) and a failed op end at once."""
    calls = []

    class Marker:
        done = False

        def query(self):
            return self.done

    marker = Marker()

    class Spy(FlightRecorder):
        def end_on_device(self, e, m):
            calls.append((e.op, m))
            super().end_on_device(e, m)

    rec = Spy()
    monkeypatch.setattr(recording, "_RECORDER", rec)
    comm = _Comm()
    comm._device_marker = lambda: marker
    _recorded("allreduce", lambda self, t: t, False)(comm, torch.ones(1))
    req = _recorded("iallreduce", lambda self, t: _Request(done_after=1), True)(
        comm, torch.ones(1))
    assert req.test() is False and len(calls) == 1
    assert req.test() is True and rec.ring[-1].end is not None  # no hand-off
    assert req.wait() == "the output" and len(calls) == 1
    gather = _recorded("iallgather", lambda self, t: _Request(), True)(comm, torch.ones(1))
    gather.wait()
    gather.wait()  # once
    assert calls == [("allreduce", marker), ("iallgather", marker)]
    assert [e.op for e in rec.pending.values()] == ["allreduce", "iallgather"]
    failing = _recorded("ireduce_scatter", lambda self, t: _Request(fail=True), True)(
        comm, torch.ones(1))
    with pytest.raises(RuntimeError):
        failing.wait()
    with pytest.raises(ValueError):
        _recorded("barrier", lambda self: (_ for _ in ()).throw(ValueError), False)(comm)
    assert len(calls) == 2 and len(rec.pending) == 2
    marker.done = True
    assert rec.reap_device() == 2 and not rec.pending and all(e.end for e in rec.ring)


def test_a_disabled_recorder_and_a_size_one_comm_record_nothing(recorder):
    allreduce = _recorded("allreduce", lambda self, t, op="sum": (t, op), False)
    iallreduce = _recorded("iallreduce", lambda self, t: "plain request", True)
    t = torch.ones(2)
    recorder.enabled = False
    assert recorder.enabled is False
    assert allreduce(_Comm(), t, op="max") == (t, "max")
    assert iallreduce(_Comm(), t) == "plain request"  # not wrapped
    recorder.enabled = True
    single = _Comm()
    single.size = 1
    assert allreduce(single, t) == (t, "sum") and iallreduce(single, t) == "plain request"
    assert not recorder.ring and not recorder.pending and recorder.count == 0
    assert allreduce(_Comm(), t)[1] == "sum" and recorder.count == 1


def test_the_op_context_manager_records_horovod_ops():
    rec = FlightRecorder()
    with rec.op("dp[0,1]", "hvd.allreduce", 16, "float32"):
        (e,) = rec.pending.values()
        assert e.end is None
    assert e.end is not None and (e.op, e.nbytes, e.dtype, e.seq) == (
        "hvd.allreduce", 16, "float32", 1)
    rec.enabled = False
    with rec.op("dp[0,1]", "hvd.allreduce"):
        pass
    assert rec.count == 1


def test_a_scripted_workload_keeps_the_last_ops_and_the_pending_one(context, monkeypatch):
    """A small ring (8) over 12 ops: the last 8 kept, numbered per group, the isend never
    waited still pending."""
    rec = FlightRecorder(8)
    monkeypatch.setattr(recording, "_RECORDER", rec)
    comm = _Comm()
    t = torch.ones(3, dtype=torch.bfloat16)
    for step in range(4):
        set_context(step=step, phase="forward")
        _recorded("allreduce", lambda self, tensor, op="sum": tensor, False)(comm, t)
        req = _recorded("isend", lambda self, tensor, dest: _Request(), True)(comm, t, 1)
        set_context(phase="backward")
        _recorded("iallgather", lambda self, tensor: _Request(), True)(comm, t).wait()
        if step < 3:
            req.wait()
    strip = [{k: v for k, v in e.as_dict().items() if k not in ("start", "end")}
             for e in rec.ring]
    assert rec.count == 12 and len(strip) == 8
    assert [e.op for e in rec.pending.values()] == ["isend"]
    assert [e.end is None for e in rec.ring] == [False] * 6 + [True, False]
    assert rec.snapshot()["seqs"] == {"dp[0,1]": 8, "dp[0,1]:p2p": 4}
    assert strip[-2] == {"seq": 4, "op": "isend", "group": "dp[0,1]", "nbytes": 6,
                         "dtype": "bfloat16", "peer": 1, "step": 3, "phase": "forward"}


def test_many_ops_leak_nothing(monkeypatch):
    """100k recorded ops: references and memory stay what the ring (capacity 64) holds."""
    rec = FlightRecorder(64)
    monkeypatch.setattr(recording, "_RECORDER", rec)
    dtype, result, comm = object(), object(), _Comm()
    tensor = SimpleNamespace(nbytes=10**20, dtype=dtype)  # a big int: a new object per read
    allreduce = _recorded("allreduce", lambda self, t, op="sum": result, False)
    iallreduce = _recorded("iallreduce", lambda self, t: _Request(), True)
    isend = _recorded("isend", lambda self, t, dest: _Request(), True)

    def run(n):
        for i in range(n):
            allreduce(comm, tensor, op="max")
            iallreduce(comm, tensor).wait()
            req = isend(comm, tensor, i)
            req.test()
            req.test()
        try:
            allreduce(comm, None, op=object())
            _recorded("barrier", lambda self: 1 / 0, False)(comm)
        except ZeroDivisionError:
            pass

    run(1000)
    gc.collect()
    watched = (dtype, result, comm, tensor, allreduce, _Comm._flight_key)
    refs = [sys.getrefcount(x) for x in watched]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    run(100_000 // 3)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert [sys.getrefcount(x) for x in watched] == refs
    assert grown < 64 * 1024, grown
    assert len(rec.ring) == 64 and not rec.pending and rec.count == 3 * 34_333 + 2 * 2


def test_the_communicator_methods_are_recorded_wrappers():
    """Bound and unbound use, introspection of the wrapped method; wrapped once."""
    import inspect

    method = base.Communicator.__dict__["allreduce"]
    assert method.__wrapped__.__name__ == "allreduce" and method.__name__ == "allreduce"
    assert method.__doc__ == method.__wrapped__.__doc__
    assert "tensor" in inspect.signature(base.Communicator.allreduce).parameters
    assert base.Communicator.allreduce is method
    recording.install()  # done once by the package import: a second call wraps nothing again
    assert base.Communicator.__dict__["allreduce"] is method
    assert not hasattr(method.__wrapped__, "__wrapped__")
    assert isinstance(flight.RECORDER, FlightRecorder) and recording._RECORDER is flight.RECORDER
