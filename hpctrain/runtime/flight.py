"""Flight recorder: every communication operation of this rank, in a bounded ring buffer.

``Communicator``'s public methods (wrapped by runtime/comm/recording.py) call
:meth:`FlightRecorder.start` and :meth:`FlightRecorder.end` around the backend hook; a
non-blocking op ends when its request completes (wait(), or a test() that returned True).
Horovod's synchronize (the ddp flavour) is recorded through :meth:`FlightRecorder.op`. Each
entry holds: the sequence number per group (collectives and point-to-point counted apart, as
NCCL's flight recorder does), op, group, bytes, dtype, peer, step and phase (from
``abort.set_context``), start and end times (``time.time()``, comparable across ranks of one
machine, roughly across nodes).

The watchdog (runtime/watchdog.py) reads the pending entries from its own thread; the ring and
the pending dict are only appended/removed under the GIL, so no lock is taken on the hot path.
Cost: two clock reads, a few dict operations and one mirror write per op; what can wait is
done when read (dtype names). Inside a training step every line runs with cold caches, so an
op costs several times its tight-loop figure: ``bench flight`` measures both, and the
recorder's share of a realistic step, whose budget is at most 1% of a step of 50 ms or more
(the 60 ms medium CPU step: 0.47% at 12.8 us per op in place on a quiet machine, 0.14-0.20%
on a loaded one, where step and wrapper slow down alike).
``RECORDER.enabled = False`` (runtime.flight_recorder = false) makes recording a single
attribute test.

Ops that complete on a device stream after the call returns (NCCL: the call only queues the
kernel) end through :meth:`FlightRecorder.end_on_device` with a marker recorded on the stream
behind them: the entry stays pending until the marker completes, so a collective hung on the
GPU is seen as pending, as PyTorch's NCCL watchdog sees it. Completion is noticed by the next
device-completing op (its front-of-queue check) or by the watchdog's poll, so such an op's end
time is when its completion was observed, an upper bound.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import threading
from collections import deque
from operator import itemgetter
from time import time as _time

from hpctrain.runtime.abort import _context
from hpctrain.runtime.timeline import TIMELINE
from hpctrain.units import human_bytes

__all__ = ["RECORDER", "FlightRecorder", "Entry", "group_key", "ranks_key", "members_of",
           "describe", "IO_PREFIX"]

def _field(i: int, settable: bool = False):
    get = itemgetter(i)
    if not settable:
        return property(get)
    return property(get, lambda self, v: self.__setitem__(i, v))


class Entry(list):
    """One operation; ``end`` is None while it is pending. A list with named fields: made
    per op on the hot path, and a list is a third of the cost of a slotted object. The dtype
    is kept as given (a torch.dtype per op costs nothing) and named when read; a last,
    unnamed field is the op's number on this rank (its key in ``pending``)."""

    __slots__ = ()
    FIELDS = ("seq", "op", "group", "nbytes", "dtype", "peer", "step", "phase", "start", "end")
    seq, op, group, nbytes = (_field(i) for i in range(4))
    peer, step, phase, start = (_field(i) for i in range(5, 9))
    end = _field(9, settable=True)

    @property
    def dtype(self) -> str:
        return dtype_name(self[4])

    def as_dict(self) -> dict:
        d = dict(zip(self.FIELDS, self))  # the op's number is not a field
        d["dtype"] = dtype_name(d["dtype"])
        return d


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """'float32' for torch.float32 (or for 'float32'); '' for None."""
    if dtype.__class__ is str:
        return dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = "" if dtype is None else str(dtype).replace("torch.", "")
    return name


def group_key(comm) -> str:
    """'name[r0,r1,...]' (world ranks) naming one instance of a group; cached on the comm.

    Two dp groups of different pipeline stages share the name, not the members."""
    key = comm.__dict__.get("_flight_key")
    if key is None:
        ranks = comm.world_ranks()
        members = _ranks_text(ranks) if ranks is not None else f"size{comm.size}"
        key = comm._flight_key = f"{getattr(comm, 'name', 'comm')}[{members}]"
    return key


def ranks_key(name: str, ranks) -> str:
    """'name[r0,r1,...]' for a group of world ranks (what group_key makes for a comm)."""
    return f"{name}[{_ranks_text(ranks)}]"


def _ranks_text(ranks) -> str:
    """'0,2' for few ranks; 'a-b' or 'a-b/step' for an arithmetic run (keys stay short at
    thousands of ranks)."""
    ranks = list(ranks)
    if len(ranks) > 2:
        d = ranks[1] - ranks[0]
        if d > 0 and all(b - a == d for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}-{ranks[-1]}" + (f"/{d}" if d > 1 else "")
    return ",".join(map(str, ranks))


def members_of(group: str, size: int) -> list[int]:
    """World ranks of a group key ('dp[0,2]', 'world[0-7]', 'dp[1-7/2]'); all ranks when
    the key does not list them."""
    inner = group[group.rfind("[") + 1:-1]
    try:
        if "-" in inner:
            first, rest = inner.split("-")
            last, _, step = rest.partition("/")
            return list(range(int(first), int(last) + 1, int(step or 1)))
        return [int(r) for r in inner.split(",")]
    except ValueError:
        return list(range(size))


#: Ops named so are steps of a checkpoint save (checkpoint/writer.py SaveSteps): file I/O,
#: not communication; their nbytes is the file's size (the watchdog allows time for it).
IO_PREFIX = "ckpt_"

P2P_OPS = frozenset(("send", "recv", "isend", "irecv", "p2p_group", "isend_boxes",
                     "irecv_boxes"))


# The last op, mirrored into a small memory-mapped file when the watchdog gives one: a rank
# that is stopped or dead cannot write a heartbeat, but what it last did is in the page cache.
# A header of six 8-byte numbers (count, seq, start, end (nan: pending), step (-1: none), the
# index of the op's names) and a table of names (op, group, phase), each written once: per op
# only numbers are stored, in one struct write (the header).
_HEADER = struct.Struct("=qqddqq")
_END_AT = 24  # the header's end field (written when the op ends)
_NAN = math.nan
_NAMES = struct.Struct("=24s48s16s")
NAME_SLOTS = 1024
MIRROR_SIZE = _HEADER.size + NAME_SLOTS * _NAMES.size


def read_mirror(path: str) -> dict | None:
    """The last op a rank recorded, from its mirror file (None when absent or empty)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MIRROR_SIZE)
        count, seq, start, end, step, index = _HEADER.unpack_from(raw)
        names = (_NAMES.unpack_from(raw, _HEADER.size + index * _NAMES.size)
                 if 0 <= index < NAME_SLOTS else (b"?", b"?", b""))
    except (OSError, struct.error):
        return None
    if count == 0:
        return None
    op, group, phase = (b.rstrip(b"\0").decode(errors="replace") for b in names)
    return {"count": count, "seq": seq, "op": op, "group": group, "phase": phase or None,
            "step": None if step < 0 else step, "start": start,
            "end": None if math.isnan(end) else end, "nbytes": 0, "peer": None}


class FlightRecorder:
    """The per-rank ring buffer of operations (see the module docstring)."""

    def __init__(self, capacity: int = 4096):
        self.mirror = None  # a writable mmap of MIRROR_SIZE bytes, set by the watchdog
        self._names: dict = {}  # (op, group, phase) -> its index in the mirror's table
        self._pack_header = self._end_view = None  # writers into the mirror's header
        self.enabled = True
        self.ring: deque = deque(maxlen=capacity)
        # each op until it completes, in start order (dicts keep insertion order): the first
        # one is the oldest
        self.pending: dict[int, Entry] = {}  # keyed by the op's number
        self.seqs: dict[str, int] = {}        # group key (+ ':p2p') -> last sequence number
        self.count = 0                        # operations started (changes = news for heartbeats)
        # (entry, marker) of ops queued on a device stream, in queue order (end_on_device);
        # appended by the main thread only, popped only under _reaping
        self.device_pending: deque = deque()
        self._reaping = threading.Lock()

    def start(self, key: str, op: str, nbytes: int = 0, dtype="", peer=None) -> Entry:
        """Record the start of ``op`` over group ``key``; return its entry for :meth:`end`.
        ``dtype``: a torch.dtype or its name.

        The hot path of every op: a few dict operations, one clock read, one mirror write."""
        skey = key if op not in P2P_OPS else key + ":p2p"
        seqs = self.seqs
        seq = seqs[skey] = seqs.get(skey, 0) + 1
        step, phase = _context.get("step"), _context.get("phase")
        self.count = count = self.count + 1
        now = _time()
        e = Entry((seq, op, key, nbytes, dtype, peer, step, phase, now, None, count))
        self.ring.append(e)
        self.pending[count] = e
        if self._pack_header is not None:  # the mirror: one struct write into the mmap
            index = self._names.get((op, key, phase))
            if index is None:
                index = self._add_names((op, key, phase))
            self._pack_header(count, seq, now, _NAN, step if step.__class__ is int else -1,
                              index)
        return e

    def set_mirror(self, mirror) -> None:
        """Mirror the last op into ``mirror`` (a writable mmap of MIRROR_SIZE bytes; None:
        stop)."""
        if self._end_view is not None:
            self._end_view.release()
        self.mirror, self._names = mirror, {}
        self._pack_header = self._end_view = None
        if mirror is not None:  # bound once: the hot path makes one call per store
            self._pack_header = functools.partial(_HEADER.pack_into, mirror, 0)
            with memoryview(mirror) as whole:  # the end field as a float64 view
                self._end_view = whole[_END_AT:_END_AT + 8].cast("d")

    def _add_names(self, names) -> int:
        """Write (op, group, phase) into the mirror's table once; its index (-1: table full)."""
        index = len(self._names) if len(self._names) < NAME_SLOTS else -1
        if index >= 0:
            op, key, phase = names
            _NAMES.pack_into(self.mirror, _HEADER.size + index * _NAMES.size,
                             op.encode()[:24], key.encode()[:48], (phase or "").encode()[:16])
        self._names[names] = index
        return index

    def end(self, e: Entry) -> None:
        """Record the completion (or failure) of ``e``."""
        e[9] = t = _time()
        self.pending.pop(e[10], None)
        if e[10] == self.count and self._end_view is not None:  # the last op: in the mirror
            self._end_view[0] = t
        if TIMELINE.enabled:  # --trace: every finished op is a span on the rank's comm row
            TIMELINE.op(e)

    def end_on_device(self, e, marker) -> None:
        """``e`` was queued on a device stream and completes when ``marker`` (``.query()`` ->
        bool, e.g. a CUDA event recorded behind the op: the communicator's
        ``_device_marker``) does: it stays pending until then. The ops queued before it that
        have completed are ended first (one query each, from the oldest; a stream completes
        in order)."""
        if self.device_pending:
            self.reap_device(front_only=True)
        self.device_pending.append((e, marker))

    def reap_device(self, front_only: bool = False) -> int:
        """End the device-queued ops whose markers have completed; how many were ended.
        ``front_only``: stop at the first still running (the main thread's cheap check);
        otherwise every marker is queried (the watchdog's poll: ops of several streams may
        complete out of queue order). A marker whose query fails ends its op: the op is
        over, and the error surfaces in the training thread."""
        if not self._reaping.acquire(blocking=False):
            return 0  # the other thread is at it
        ended = 0
        try:
            dp = self.device_pending
            i = 0
            while i < len(dp):  # by index: the main thread may append meanwhile
                e, marker = dp[i]
                i += 1
                if e[9] is None:
                    try:
                        done = marker.query()
                    except Exception:  # noqa: BLE001 - see the docstring
                        done = True
                    if not done:
                        if front_only:
                            break
                        continue
                    self.end(e)
                    ended += 1
            while dp and dp[0][0][9] is not None:  # drop the ended ones at the front
                dp.popleft()
        finally:
            self._reaping.release()
        return ended

    def op(self, key: str, op: str, nbytes: int = 0, dtype: str = ""):
        """Context manager recording one op not issued through a Communicator (Horovod)."""
        return _Scope(self, key, op, nbytes, dtype)

    def oldest_pending(self) -> Entry | None:
        """The pending op started first (ops may complete in any order)."""
        pend = list(self.pending.values())  # one C-level copy: safe against the main thread
        return pend[0] if pend else None

    def snapshot(self, last: int = 0) -> dict:
        """A JSON-able view: the ring (or its ``last`` entries), pending ops and sequence numbers."""
        if self.device_pending:
            self.reap_device()
        ring = list(self.ring)
        if last:
            ring = ring[-last:]
        return {"entries": [e.as_dict() for e in ring],
                "pending": [e.as_dict() for e in list(self.pending.values())],
                "seqs": dict(self.seqs), "count": self.count}

    def dump(self, path: str, **info) -> None:
        """Write the whole record (plus ``info``: rank, host, ...) to ``path`` atomically."""
        write_json(path, {**info, **self.snapshot()})


class _Scope:
    def __init__(self, rec, key, op, nbytes, dtype):
        self._args = (rec, key, op, nbytes, dtype)
        self._e = None

    def __enter__(self):
        rec, key, op, nbytes, dtype = self._args
        if rec.enabled:
            self._e = rec.start(key, op, nbytes, dtype)
        return self

    def __exit__(self, *exc):
        if self._e is not None:
            self._args[0].end(self._e)
        return False


def write_json(path: str, data) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary name (readers never see half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    text = json.dumps(data)  # the C encoder (json.dump's is pure Python): less GIL time
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def describe(e: dict) -> str:
    """'forward, allreduce #12 over dp[0,1] (8.0 MB float32), done' for one entry dict."""
    size = e.get("nbytes") or 0
    what = f"{e['op']} #{e['seq']} over {e['group']}"
    if e.get("peer") is not None:
        what += f" peer {e['peer']}"
    if size:
        what += f" ({human_bytes(size)} {e.get('dtype') or ''})".replace(" )", ")")
    state = "pending" if e.get("end") is None else "done"
    where = ", ".join(str(x) for x in (e.get("phase"),) if x)
    step = f"step {e['step']} " if e.get("step") is not None else ""
    return f"{step}{where + ', ' if where else ''}{what}, {state}"



#: The recorder of this process (one per rank; every communicator records into it).
RECORDER = FlightRecorder()
