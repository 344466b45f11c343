"""A timeline of the run (``--trace DIR``): Chrome trace / Perfetto JSON, one row per rank.

Each rank keeps its events in memory while it trains and writes ``DIR/trace-rank-R.json``
at the end; rank 0 merges them into ``DIR/trace.json`` (open it in chrome://tracing or
ui.perfetto.dev), as Horovod's timeline (HOROVOD_TIMELINE) shows one row per tensor. What
goes in, per rank (pid = rank):

- the phases the trainer and the strategies mark (forward, backward, optimizer,
  checkpoint), as spans on thread "phases": one ``phase`` call closes the previous span;
- every communication operation the flight recorder sees end (runtime/flight.py:
  collectives and point-to-point, halo exchanges included), with its group, sequence
  number, bytes and dtype, on thread "comm";
- pipeline actions (forward/backward of a micro-batch's chunk), on thread "pipeline".

Times are ``time.time()`` (comparable across the ranks of a machine, roughly across nodes),
written as microseconds since the earliest event of the job. Off (``enabled`` False) the
hooks cost one attribute test.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["TIMELINE", "Timeline", "merge"]

_THREADS = {"phases": 0, "comm": 1, "pipeline": 2}


class Timeline:
    """This rank's events (see the module docstring)."""

    def __init__(self):
        self.enabled = False
        self.directory, self.rank = "", 0
        self.events: list = []
        self._phase = None  # (name, start time) of the open phase span
        self._offset = 0.0  # time.time() - time.perf_counter()

    def enable(self, directory: str, rank: int) -> None:
        """Start recording this rank's events for ``directory``."""
        self.directory, self.rank, self.events, self._phase = directory, rank, [], None
        self._offset = time.time() - time.perf_counter()
        self.enabled = True

    def wall(self, perf: float) -> float:
        """A time.perf_counter() reading as time.time()."""
        return perf + self._offset

    def span(self, name: str, thread: str, start: float, end: float, **args) -> None:
        """One complete event [start, end] (time.time() seconds) on the rank's ``thread``."""
        self.events.append({"name": name, "cat": thread, "ph": "X", "ts": start * 1e6,
                            "dur": max(0.0, end - start) * 1e6, "pid": self.rank,
                            "tid": _THREADS[thread], "args": args})

    def phase(self, name: str | None, now: float | None = None) -> None:
        """Close the open phase span and open ``name`` (None: just close)."""
        now = time.time() if now is None else now
        if self._phase is not None and self._phase[0] != name:
            self.span(self._phase[0], "phases", self._phase[1], now)
        if name is None:
            self._phase = None
        elif self._phase is None or self._phase[0] != name:
            self._phase = (name, now)

    def op(self, entry) -> None:
        """A finished flight-recorder entry (runtime/flight.Entry)."""
        args = {"group": entry.group, "seq": entry.seq, "bytes": entry.nbytes,
                "dtype": entry.dtype, "step": entry.step}
        if entry.peer is not None:
            args["peer"] = entry.peer
        self.span(entry.op, "comm", entry.start, entry.end, **args)

    def write(self) -> str:
        """Write DIR/trace-rank-R.json (closing the open phase); return its path."""
        self.phase(None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"trace-rank-{self.rank}.json")
        with open(path, "w") as fh:
            json.dump(self.events, fh)
        self.enabled = False
        return path


def merge(directory: str, size: int) -> str:
    """Merge DIR/trace-rank-{0..size-1}.json into DIR/trace.json (rank 0, after every rank
    wrote its file); return its path. Times become microseconds since the first event."""
    events = []
    for r in range(size):
        with open(os.path.join(directory, f"trace-rank-{r}.json")) as fh:
            events.extend(json.load(fh))
    t0 = min((e["ts"] for e in events), default=0.0)
    for e in events:
        e["ts"] = round(e["ts"] - t0, 3)
        e["dur"] = round(e["dur"], 3)
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
            for r in range(size)]
    meta += [{"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}}
             for r in range(size) for name, tid in _THREADS.items()]
    path = os.path.join(directory, "trace.json")
    with open(path, "w") as fh:
        json.dump({"traceEvents": meta + sorted(events, key=lambda e: (e["pid"], e["ts"])),
                   "displayTimeUnit": "ms"}, fh)
    return path


#: The process's timeline (one per process, as the flight recorder).
TIMELINE = Timeline()
