"""Ops that complete on a device stream (NCCL) stay pending in the flight recorder until the
stream has run them, so the watchdog sees a collective hung on the GPU (no MPI, no GPU: the
markers are fakes with a switch; the CUDA marker itself is checked where a GPU is).
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from hpctrain.runtime import flight
from hpctrain.runtime.comm import base, recording
from hpctrain.runtime.watchdog import Watchdog


class _Marker:
    """A stream marker: query() is False until ``done`` (or raises when ``broken``)."""

    def __init__(self):
        self.done, self.broken, self.queries = False, False, 0

    def query(self):
        self.queries += 1
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access")
        return self.done


class _Comm:
    """A communicator whose ops complete on the device: each op's marker is kept."""

    size = 2
    _flight_key = "dp[0,1]"

    def __init__(self):
        self.markers = []

    def _device_marker(self):
        self.markers.append(_Marker())
        return self.markers[-1]


class _Request:
    def __init__(self, done=False):
        self.done, self.waits = done, 0

    def wait(self):
        self.waits += 1

    def test(self):
        return self.done


@pytest.fixture
def k(monkeypatch):
    """A fresh recorder in place of the process's one (``k.rec``), the wrapper
    (``k.recorded``) and two wrapped ops."""
    rec, wrap = flight.FlightRecorder(), recording._recorded
    monkeypatch.setattr(recording, "_RECORDER", rec)
    return SimpleNamespace(rec=rec, recorded=wrap,
                           allreduce=wrap("allreduce", lambda self, t, op="sum": None, False),
                           iallreduce=wrap("iallreduce", lambda self, t, op="sum": _Request(),
                                           True))


def test_a_queued_op_stays_pending_until_its_marker_completes(k):
    comm = _Comm()
    k.allreduce(comm, torch.ones(4))
    k.allreduce(comm, torch.ones(4))
    first, second = k.rec.ring
    assert list(k.rec.pending.values()) == [first, second] and first.end is None
    assert k.rec.oldest_pending() is first  # what the watchdog times
    comm.markers[0].done = True
    k.allreduce(comm, torch.ones(4))  # the next queued op ends the completed ones before it
    assert first.end is not None and second.end is None
    assert comm.markers[1].queries == 1  # the front check stops at the first running one
    assert [e for e, _ in k.rec.device_pending] == [second, k.rec.ring[2]]
    for m in comm.markers:
        m.done = True
    assert k.rec.reap_device() == 2 and not k.rec.pending and not k.rec.device_pending


def test_the_full_scan_ends_ops_of_other_streams_out_of_order(k):
    """Front-only stops at a running op; the watchdog's scan ends the later ones already done
    (ops of several streams); they leave the queue once everything before them has."""
    comm = _Comm()
    for _ in range(3):
        k.allreduce(comm, torch.ones(2))
    a, b, c = k.rec.ring
    comm.markers[1].done = comm.markers[2].done = True
    assert k.rec.reap_device(front_only=True) == 0 and b.end is None
    assert k.rec.reap_device() == 2 and (a.end, b.end is None, c.end is None) == (None,
                                                                                      False, False)
    assert len(k.rec.device_pending) == 3 and k.rec.oldest_pending() is a
    comm.markers[0].done = True
    assert k.rec.reap_device(front_only=True) == 1 and not k.rec.device_pending


def test_a_waited_request_is_handed_to_the_device_once(k):
    """wait() queues the stream behind the op (NCCL), so the entry waits for the marker, once
    however often wait() is called; test() True means complete on the device: ended there."""
    comm = _Comm()
    req = k.iallreduce(comm, torch.ones(3))
    (e,) = k.rec.pending.values()
    req.wait()
    req.wait()
    assert len(comm.markers) == 1 and e.end is None and len(k.rec.device_pending) == 1
    comm.markers[0].done = True
    k.rec.reap_device()
    assert e.end is not None and not k.rec.pending
    polled = k.iallreduce(comm, torch.ones(3))
    polled._req.done = True
    assert polled.test() is True and k.rec.ring[-1].end is not None
    polled.wait()
    assert len(comm.markers) == 1 and not k.rec.device_pending  # no second hand-off


def test_a_failing_op_or_marker_ends_its_entry(k):
    comm = _Comm()
    broken = k.recorded("allreduce", lambda self, t, op="sum": 1 / 0, False)
    with pytest.raises(ZeroDivisionError):
        broken(comm, torch.ones(2))
    assert not k.rec.pending and not comm.markers  # the op never ran: no marker
    k.allreduce(comm, torch.ones(2))
    comm.markers[0].broken = True  # the error surfaces in the training thread, not here
    assert k.rec.reap_device() == 1 and not k.rec.pending


def test_a_snapshot_reaps_first(k):
    comm = _Comm()
    k.allreduce(comm, torch.ones(2))
    comm.markers[0].done = True
    snap = k.rec.snapshot()
    assert not snap["pending"] and snap["entries"][0]["end"] is not None


def _watch(rec, tmp_path, timeout_s):
    """A watchdog over ``rec`` whose stall request is caught instead of ending the job."""
    dog = Watchdog(timeout_s, str(tmp_path), str(tmp_path), rank=0, size=2, recorder=rec)
    requested = []
    dog._request = requested.append
    dog.start()
    return dog, requested


def test_the_watchdog_reports_an_op_hung_on_the_device(k, tmp_path):
    comm = _Comm()
    k.allreduce(comm, torch.ones(8))  # the call returned; the GPU never runs it
    dog, requested = _watch(k.rec, tmp_path, 0.3)
    dog.join(5)
    assert requested == [k.rec.ring[0]]
    assert requested[0].op == "allreduce" and requested[0].end is None


def test_the_watchdog_ends_device_ops_that_complete(k, tmp_path):
    """A GPU merely behind the host is never reported: the watchdog's poll ends the queued
    ops as they complete, though no further op comes to end them."""
    comm = _Comm()
    k.allreduce(comm, torch.ones(8))
    dog, requested = _watch(k.rec, tmp_path, 0.5)
    try:
        threading.Timer(0.2, lambda: setattr(comm.markers[0], "done", True)).start()
        deadline = time.time() + 5
        while k.rec.pending and time.time() < deadline:
            time.sleep(0.02)
        assert not k.rec.pending and not k.rec.device_pending
        time.sleep(0.7)  # past the timeout: nothing is reported
        assert requested == [] and dog.is_alive()
    finally:
        dog.stop()


def test_a_backend_timeout_is_extended_past_the_report():
    dog = Watchdog(600, "/nonexistent", "/nonexistent", rank=0, size=2)
    assert dog.report_window_s > 600 + 2 * dog.grace
    base.Communicator.extend_op_timeout(None, 1e6)  # MPI: no timeout of its own, a no-op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_nccl_marker_completes_behind_the_stream():
    from hpctrain.runtime.comm.torchdist import _stream_marker

    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x.T / 2048
    marker = _stream_marker()
    torch.cuda.synchronize()
    assert marker.query() is True
