"""Stall watchdog: a thread per rank that ends a job stuck in a communication operation.

Every ``poll`` seconds the thread (1) publishes a small heartbeat of this rank's flight record
(last entries, pending ops, sequence numbers per group) and (2) checks the oldest pending op.
When one has been pending longer than ``runtime.collective_timeout_s``:

1. the rank asks every rank to report, by creating ``<channel>/request``;
2. each rank that is alive (its watchdog sees the request within one poll) writes its Python
   stack (faulthandler, all threads) to ``<out_dir>/stall-rank-R.txt``, its whole flight record
   to ``<out_dir>/flight-rank-R.json`` and a final heartbeat marked ``responded``;
3. after a grace period the first rank to create ``<channel>/report`` (O_EXCL: exactly one)
   reads every heartbeat, prints ONE report naming the op, the step, the ranks pending in it,
   the ranks that never entered it and what those last recorded, writes it to
   ``<out_dir>/stall-report.txt``, and calls MPI_Abort (exit code 1): the scheduler frees
   the nodes. Other ranks abort too if that rank has not after a second grace period.

The heartbeat is written at most every HEARTBEAT_S (0.5 s), and only when it changed; the
rank's very last op is also mirrored into a memory-mapped file on every op (exact, ~0.5 us).
The channel is a per-job directory, not a communicator: it keeps working when a rank is stopped
(SIGSTOP) or dead, and needs no MPI call while the stuck one is still in progress. It is made
by rank 0 at start (under out_dir, or the system temp dir when out_dir is "": then it is
node-local, so on several nodes the report covers only the ranks of the reporting node, and
the stall-rank-R.txt / flight-rank-R.json files go into a visible ``hpctrain-stall-*``
folder beside it; the report names the path). It is working state, never evidence, and is
removed on every end a process can act on: :meth:`Watchdog.stop` at the end of a run (and
at exit), any rank that aborts the job (an exception, failing together), and the reporter of
a stall once its report is written. A job killed by a signal (SIGKILL; SIGTERM where training
does not handle it: a Python handler would keep a rank stuck in MPI from dying) leaves it;
the next start in the same directory removes it (``sweep_stale``: its owner is gone). A
stopped rank's heartbeat is at most 0.5 s old; its mirror is exact.
A rank merely slower than the timeout (long evaluation or checkpoint on rank 0) never
triggers it: the others' pending op completes before the timeout.

This module is the thread and its start; the channel's files and their removal are
watchdog_channel.py's, the report's wording stall_report.py's.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import mmap
import os
import socket
import sys
import threading
import time

from hpctrain.runtime import abort
from hpctrain.runtime.flight import MIRROR_SIZE, RECORDER, describe, write_json
from hpctrain.runtime.stall_report import compose_report, io_allowance_s
from hpctrain.runtime.watchdog_channel import (REPORT, REQUEST, heartbeat_path, make_channel,
                                               mirror_path, remove_channel, stall_dir_of)

__all__ = ["Watchdog", "start_watchdog"]

# Heartbeats (per-group sequence numbers, last entries) at most this often: a JSON write costs
# ~0.1-1 ms of this rank's time. The exact last op comes from the mmap mirror anyway.
HEARTBEAT_S = 0.5


class Watchdog(threading.Thread):
    """See the module docstring. ``rank``/``size`` are world ranks."""

    def __init__(self, timeout_s: float, channel: str, out_dir: str, rank: int, size: int,
                 recorder=RECORDER, owner: bool = False):
        super().__init__(name="hpctrain-watchdog", daemon=True)
        self.timeout_s, self.channel, self.out_dir = timeout_s, channel, out_dir
        self.rank, self.size, self.rec, self._owner = rank, size, recorder, owner
        # 10 Hz checks (a look at the pending dict and one stat): ranks answer a report
        # request within 0.1 s.
        self.poll = max(0.02, min(0.1, timeout_s / 10))
        self.grace = max(3 * self.poll + 1.0, min(10.0, timeout_s / 2))
        self._stop_event = threading.Event()
        self._mirror_file = None
        self._next_hb = 0.0
        self.stopped = False
        self._last_count = -1
        self._responded = False
        self._reported = False  # this rank wrote the stall report: the channel may go
        self._host = socket.gethostname()

    @property
    def report_window_s(self) -> float:
        """From an op's start to the abort at the latest: timeout, a poll, both graces and
        the 5 s margin of the ranks that did not report; torch's own op timeout must be
        longer, or its watchdog ends the process before the report (Trainer sees to it)."""
        return self.timeout_s + self.poll + 2 * self.grace + 5 + 10

    # ---- the loop ----------------------------------------------------------------------

    def attach_mirror(self) -> None:
        """Mirror the recorder's last op into ``<channel>/last-R.bin`` (read if we stop)."""
        path = mirror_path(self.channel, self.rank)
        with open(path, "wb") as f:
            f.write(b"\0" * MIRROR_SIZE)
        self._mirror_file = open(path, "r+b")
        self.rec.set_mirror(mmap.mmap(self._mirror_file.fileno(), MIRROR_SIZE))

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.poll):
                if os.path.exists(os.path.join(self.channel, REQUEST)):
                    self._respond()
                    return
                if self.rec.device_pending:  # NCCL ops end when the GPU has run them
                    self.rec.reap_device()
                self._heartbeat()
                e = self.rec.oldest_pending()
                if e is not None and time.time() - e.start > self.timeout_s + io_allowance_s(
                        e.op, e.nbytes):
                    self._request(e)
                    return
        except Exception as exc:  # noqa: BLE001 - a broken watchdog must not kill training
            print(f"hpctrain: watchdog on rank {self.rank} stopped: {exc!r}", file=sys.stderr,
                  flush=True)

    def stop(self) -> None:
        """End the thread (clean shutdown; local) and, on rank 0, remove the channel."""
        self.stopped = True
        self._stop_event.set()
        self.rec.set_mirror(None)
        if self._owner:
            remove_channel(self.channel)

    def discard_channel(self) -> None:
        """Remove the channel when this rank aborts the job (an exception, ranks failing
        together; any rank: the directory is shared by the ranks of a node or a file
        system), unless a stall is being reported from it and this rank is not the
        reporter (the heartbeats and mirrors are what the report is made from)."""
        if self._reported or not os.path.exists(os.path.join(self.channel, REQUEST)):
            self.stopped = True
            self._stop_event.set()
            remove_channel(self.channel)

    # ---- heartbeats and records ---------------------------------------------------------

    def _heartbeat(self, force: bool = False, **extra) -> None:
        count = self.rec.count
        pend = len(self.rec.pending)
        now = time.monotonic()
        if not force and ((count, pend) == self._last_count or now < self._next_hb):
            return  # nothing new, or written less than HEARTBEAT_S ago: no file write
        self._next_hb = now + HEARTBEAT_S
        self._last_count = (count, pend)
        try:
            write_json(heartbeat_path(self.channel, self.rank), {
                "rank": self.rank, "host": self._host, "pid": os.getpid(),
                "time": time.time(), **self.rec.snapshot(last=4), **extra})
        except FileNotFoundError:
            pass  # rank 0 removed the channel at the end of a clean run

    def _dump(self, reason: str) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        stack = os.path.join(self.out_dir, f"stall-rank-{self.rank}.txt")
        pend = [describe(e.as_dict()) for e in list(self.rec.pending.values())]
        with open(stack, "w") as f:
            f.write(f"rank {self.rank} on {socket.gethostname()} pid {os.getpid()}: {reason}\n")
            f.write("".join(f"pending: {p}\n" for p in pend) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.rec.dump(os.path.join(self.out_dir, f"flight-rank-{self.rank}.json"),
                      rank=self.rank, size=self.size, host=socket.gethostname(),
                      time=time.time())
        self._heartbeat(force=True, responded=True)

    # ---- the stall ----------------------------------------------------------------------

    def _request(self, e) -> None:
        """This rank saw the stall first (or among the first): ask all ranks, then report."""
        if not os.path.isdir(self.channel):
            return  # a reporter removed it and is ending the job (this rank was stopped)
        try:
            fd = os.open(os.path.join(self.channel, REQUEST), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, json.dumps({"rank": self.rank, "entry": e.as_dict()}).encode())
            os.close(fd)
        except FileExistsError:
            pass
        except FileNotFoundError:
            return  # removed meanwhile, as above
        self._respond(e)

    def _respond(self, own=None) -> None:
        if not os.path.isdir(self.channel) or os.path.exists(
                os.path.join(self.channel, REPORT)):
            return  # reported already: Open MPI's abort SIGCONTs a stopped rank before killing it
        self._dump("stall reported" if own is None else
                   f"pending longer than {self.timeout_s:g} s: {describe(own.as_dict())}")
        time.sleep(self.grace)  # the other live ranks write their stacks meanwhile
        try:
            fd = os.open(os.path.join(self.channel, REPORT), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            time.sleep(self.grace + 5)  # the reporter aborts the job; if it died, we do
            print(f"hpctrain: watchdog on rank {self.rank}: aborting the stalled job",
                  file=sys.stderr, flush=True)
            abort._abort(1)
            return
        except FileNotFoundError:
            return  # the reporter is ending the job and removed the channel
        os.close(fd)
        report = compose_report(self.channel, self.size, self.timeout_s, self.out_dir)
        with open(os.path.join(self.out_dir, "stall-report.txt"), "w") as f:
            f.write(report + "\n")
        sys.stderr.write(report + "\n")
        self._reported = True  # the abort's hook removes the channel: its work is done
        abort._abort(1)


_ACTIVE: Watchdog | None = None


def start_watchdog(timeout_s: float, out_dir: str, mpi_comm) -> Watchdog | None:
    """Start this rank's watchdog (collective over ``mpi_comm``: rank 0 makes the channel and
    shares its path). Returns None (nothing started) when ``timeout_s`` <= 0 or one rank."""
    global _ACTIVE
    if timeout_s <= 0 or mpi_comm.Get_size() == 1:
        return None
    if _ACTIVE is not None and not _ACTIVE.stopped:  # not is_alive(): that differs by rank
        return _ACTIVE                                # for a moment after stop()
    rank = mpi_comm.Get_rank()
    channel = make_channel(out_dir or None) if rank == 0 else None
    channel = mpi_comm.bcast(channel, root=0)  # bootstrap only: a pickled string is fine
    dog = Watchdog(timeout_s, channel, out_dir or stall_dir_of(channel), rank,
                   mpi_comm.Get_size(), owner=rank == 0)
    dog.attach_mirror()
    dog.start()
    # A process that ends without fit()'s clean stop (a script driving steps itself, an
    # exception caught by the caller) still removes the channel: 120 of them had piled
    # up in /tmp. An abort (MPI_Abort, os._exit) runs the hook below instead.
    atexit.register(dog.stop)
    abort.BEFORE_ABORT.append(dog.discard_channel)  # MPI_Abort skips atexit
    _ACTIVE = dog
    return dog
