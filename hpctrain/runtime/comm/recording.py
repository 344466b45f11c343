"""The flight recorder's wrappers around the Communicator's public operations.

One wrapper around each public operation (blocking and non-blocking collectives, point to
point, ``split``), so every backend and every strategy is recorded alike; size-1
communicators are skipped (nothing can stall there). The wrappers are put on
``Communicator`` once, by :func:`install`, when the ``hpctrain.runtime.comm`` package is
imported (before any backend: each inherits them). A wrapper reads ``_RECORDER`` from this
module's globals at each call (tests swap it).
"""

from __future__ import annotations

from hpctrain.runtime.comm.base import BLOCKING_OPS, NONBLOCKING_OPS, Communicator
from hpctrain.runtime.comm.requests import Request
from hpctrain.runtime.flight import RECORDER as _RECORDER, group_key

__all__ = ["install"]



class _RecordedRequest(Request):
    """A non-blocking op's request whose completion ends its flight entry; other attributes
    (``out``) are the wrapped request's. ``marker``: the communicator's ``_device_marker``
    (the entry of a waited op then ends on the device)."""

    __slots__ = ("_req", "_entry", "_rec", "_marker", "_finished")

    def __init__(self, request, entry, recorder, marker=None):
        self._req, self._entry, self._rec, self._marker = request, entry, recorder, marker
        self._finished = False  # ended, or handed to the device (its end then comes later)

    def wait(self):
        try:
            result = self._req.wait()
        except BaseException:
            if self._entry[9] is None:
                self._rec.end(self._entry)
            raise
        if not self._finished:
            self._finished = True
            if self._entry[9] is None:  # NCCL: the wait only queued the stream behind the op
                _finish(self._rec, self._entry, self._marker)
        return result

    def test(self) -> bool:
        done = self._req.test()  # True: complete, on the device too (NCCL's is_completed)
        if done and not self._finished:
            self._finished = True
            if self._entry[9] is None:
                self._rec.end(self._entry)
        return done

    def __getattr__(self, attr):
        return getattr(self._req, attr)


def _finish(rec, entry, marker) -> None:
    """The op completed: end its entry, on the device when the communicator has a marker
    factory (NCCL: the end is when the stream reaches the marker, not when the call returns)."""
    if marker is None:
        rec.end(entry)
    else:
        rec.end_on_device(entry, marker())


def _tensor_size(args, kwargs):
    """(bytes, dtype, None) of a collective's first tensor argument (the dtype object: the
    recorder names it only when read)."""
    t = args[0] if args else kwargs.get("tensor")
    try:  # cheaper than isinstance(t, torch.Tensor) (torch's metaclass check)
        return t.nbytes, t.dtype, None
    except AttributeError:
        return 0, "", None


def _peer_sized(peer_at: int):
    """The sizing function of a point-to-point op whose peer is argument ``peer_at``
    (send/recv/isend/irecv(tensor, peer, ...): 1; isend_boxes/irecv_boxes(tensor, boxes,
    peer, ...): 2)."""
    def size(args, kwargs):
        t = args[0] if args else kwargs.get("tensor")
        peer = args[peer_at] if len(args) > peer_at else kwargs.get("dest", kwargs.get("source"))
        try:
            return t.nbytes, t.dtype, peer
        except AttributeError:
            return 0, "", peer
    return size


_p2p_size, _boxes_size = _peer_sized(1), _peer_sized(2)


def _group_size(args, kwargs):
    """p2p_group(sends, recvs): every tensor, every peer."""
    items = [*(args[0] if args else kwargs.get("sends", ())),
             *(args[1] if len(args) > 1 else kwargs.get("recvs", ()))]
    nbytes = sum(t.nbytes for t, _, _ in items)
    dtype = items[0][0].dtype if items else ""
    return nbytes, dtype, sorted({p for _, p, _ in items}) or None


def _scalars_size(args, kwargs):
    values = args[0] if args else kwargs.get("values", ())
    return 8 * len(values), "float64", None


_SIZERS = {"send": _p2p_size, "recv": _p2p_size, "isend": _p2p_size, "irecv": _p2p_size,
           "isend_boxes": _boxes_size, "irecv_boxes": _boxes_size, "p2p_group": _group_size,
           "allreduce_scalars": _scalars_size}


def _recorded(name: str, fn, nonblocking: bool):
    """``fn`` wrapped to record each call in the flight recorder. Every op goes through
    this, so it is written for speed (inside a training step every line runs with cold
    caches): one sizing function chosen here, the group key cached on the communicator."""
    size_of = _SIZERS.get(name, _tensor_size)

    def method(self, *args, **kwargs):
        rec = _RECORDER
        if not rec.enabled or self.size <= 1:
            return fn(self, *args, **kwargs)
        nbytes, dtype, peer = size_of(args, kwargs)
        entry = rec.start(self._flight_key or group_key(self), name, nbytes, dtype, peer)
        try:
            result = fn(self, *args, **kwargs)
        except BaseException:
            rec.end(entry)
            raise
        marker = getattr(self, "_device_marker", None)
        if nonblocking:
            return _RecordedRequest(result, entry, rec, marker)
        _finish(rec, entry, marker)
        return result

    method.__name__, method.__qualname__, method.__doc__ = name, fn.__qualname__, fn.__doc__
    method.__wrapped__ = fn
    return method


def install() -> None:
    """Put the wrappers on ``Communicator``'s public ops; the comm package calls it once on
    import. A second call changes nothing (an op is never recorded twice)."""
    if "_flight_key" in Communicator.__dict__:
        return
    Communicator._flight_key = None  # the group key, set per instance by group_key
    for name in BLOCKING_OPS + NONBLOCKING_OPS:
        setattr(Communicator, name, _recorded(name, getattr(Communicator, name),
                                              name in NONBLOCKING_OPS))
