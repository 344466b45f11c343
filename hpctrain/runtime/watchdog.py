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
the next start in the same directory removes it (``_sweep_stale``: its owner is gone). A
stopped rank's heartbeat is at most 0.5 s old; its mirror is exact.
A rank merely slower than the timeout (long evaluation or checkpoint on rank 0) never
triggers it: the others' pending op completes before the timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import mmap
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from hpctrain.runtime import abort
from hpctrain.runtime.flight import (IO_PREFIX, MIRROR_SIZE, RECORDER, describe, human_bytes,
                                    members_of, read_mirror, write_json)

__all__ = ["Watchdog", "start_watchdog", "compose_report"]

# Heartbeats (per-group sequence numbers, last entries) at most this often: a JSON write costs
# ~0.1-1 ms of this rank's time. The exact last op comes from the mmap mirror anyway.
HEARTBEAT_S = 0.5
# A checkpoint step (an op named ckpt_*, its bytes the file's) may wait while another rank
# writes: on top of the timeout, the time the whole file takes at this floor of a parallel
# file system's speed (20 MB/s: 1 GB adds 50 s). A save that has not ended by then is stuck.
IO_FLOOR_BPS = 20e6


def io_allowance_s(op: str, nbytes) -> float:
    """Seconds an op may take beyond the timeout: the I/O of a checkpoint step, else none."""
    return (nbytes or 0) / IO_FLOOR_BPS if op.startswith(IO_PREFIX) else 0.0


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
        path = os.path.join(self.channel, f"last-{self.rank}.bin")
        with open(path, "wb") as f:
            f.write(b"\0" * MIRROR_SIZE)
        self._mirror_file = open(path, "r+b")
        self.rec.set_mirror(mmap.mmap(self._mirror_file.fileno(), MIRROR_SIZE))

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.poll):
                if os.path.exists(os.path.join(self.channel, "request")):
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
            _remove(self.channel)

    def discard_channel(self) -> None:
        """Remove the channel when this rank aborts the job (an exception, ranks failing
        together; any rank: the directory is shared by the ranks of a node or a file
        system), unless a stall is being reported from it and this rank is not the
        reporter (the heartbeats and mirrors are what the report is made from)."""
        if self._reported or not os.path.exists(os.path.join(self.channel, "request")):
            self.stopped = True
            self._stop_event.set()
            _remove(self.channel)

    # ---- heartbeats and records ---------------------------------------------------------

    def _hb_path(self, rank: int) -> str:
        return os.path.join(self.channel, f"hb-{rank}.json")

    def _heartbeat(self, force: bool = False, **extra) -> None:
        count = self.rec.count
        pend = len(self.rec.pending)
        now = time.monotonic()
        if not force and ((count, pend) == self._last_count or now < self._next_hb):
            return  # nothing new, or written less than HEARTBEAT_S ago: no file write
        self._next_hb = now + HEARTBEAT_S
        self._last_count = (count, pend)
        try:
            write_json(self._hb_path(self.rank), {
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
            fd = os.open(os.path.join(self.channel, "request"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, json.dumps({"rank": self.rank, "entry": e.as_dict()}).encode())
            os.close(fd)
        except FileExistsError:
            pass
        except FileNotFoundError:
            return  # removed meanwhile, as above
        self._respond(e)

    def _respond(self, own=None) -> None:
        if not os.path.isdir(self.channel) or os.path.exists(
                os.path.join(self.channel, "report")):
            return  # reported already: Open MPI's abort SIGCONTs a stopped rank before killing it
        self._dump("stall reported" if own is None else
                   f"pending longer than {self.timeout_s:g} s: {describe(own.as_dict())}")
        time.sleep(self.grace)  # the other live ranks write their stacks meanwhile
        try:
            fd = os.open(os.path.join(self.channel, "report"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
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


def _remove(channel: str) -> None:
    """Remove the channel while other ranks may still write into it: renamed first (one
    atomic step), so that a rank's late file (a heartbeat, a 'report' claim) fails to find
    the directory instead of landing in one being emptied (and keeping it)."""
    gone = f"{channel}.gone{os.getpid()}"
    try:
        os.rename(channel, gone)
    except OSError:
        return  # removed (or being removed) by another rank
    shutil.rmtree(gone, ignore_errors=True)


def _peers(e: dict, members: list[int]) -> list[int]:
    """World ranks of a p2p entry's peers (group ranks in the entry)."""
    peers = e["peer"] if isinstance(e["peer"], list) else [e["peer"]]
    return [members[p] if p < len(members) else p for p in peers]


def _culprit_op(req: dict, beats: dict, responded: list[int], size: int):
    """(rank, entry) of the pending op that best explains the stall: a collective (then a
    p2p op) whose group holds a rank that did not respond, the oldest first. When every rank
    responded (a collective skipped or issued out of order), the oldest pending op of all:
    the first rank to get stuck waits where the others diverged (the request's op, which
    timed out first by a poll's luck, can be a later one)."""
    blamed, oldest = None, None
    for r in responded:
        for e in beats[r].get("pending") or []:
            members = _members(e["group"], size)
            collective = e.get("peer") is None
            involved = members if collective else _peers(e, members)
            if any(m not in responded for m in involved):
                key = (not collective, e["start"])
                if blamed is None or key < blamed[0]:
                    blamed = (key, (r, e))
            elif oldest is None or e["start"] < oldest[0]:
                oldest = (e["start"], (r, e))
    if blamed is not None:
        return blamed[1]
    if oldest is not None and len(responded) == size:
        return oldest[1]
    return req["rank"], req["entry"]


def _entered(last: dict | None, group: str, seq: int) -> bool:
    return last is not None and last["group"] == group and last["seq"] >= seq


def _load_heartbeats(channel: str, size: int) -> dict[int, dict]:
    beats = {}
    for r in range(size):
        try:
            with open(os.path.join(channel, f"hb-{r}.json")) as f:
                beats[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return beats


_members = members_of


def compose_report(channel: str, size: int, timeout_s: float, out_dir: str) -> str:
    """The one stall report, from the request and every rank's heartbeat."""
    with open(os.path.join(channel, "request")) as f:
        req = json.load(f)
    beats = _load_heartbeats(channel, size)
    # A silent rank's heartbeat can be a poll old; its mirror holds its very last op.
    mirrors = {r: read_mirror(os.path.join(channel, f"last-{r}.bin")) for r in range(size)}
    responded = sorted(r for r, b in beats.items() if b.get("responded"))
    owner, e = _culprit_op(req, beats, responded, size)
    group, seq = e["group"], e["seq"]
    collective = e.get("peer") is None
    members = _members(group, size)
    if collective:
        entered = [r for r in members if r in beats and (
            beats[r]["seqs"].get(group, 0) >= seq or _entered(mirrors.get(r), group, seq))]
    else:  # p2p sequence numbers differ between peers: the peers' answer is what we know
        members = [owner] + _peers(e, members)
        entered = [r for r in members if r == owner or r in responded]
    entered = sorted(set(entered))
    never = sorted(set(r for r in members if r not in entered))
    silent = [r for r in range(size) if r not in responded]
    waited = time.time() - e["start"]
    size_txt = f" ({human_bytes(e['nbytes'])})" if e.get("nbytes") else ""
    step = f"step {e['step']}: " if e.get("step") is not None else ""
    extra = io_allowance_s(e["op"], e.get("nbytes"))
    limit = f"timeout {timeout_s:g} s" + (f" + {extra:.0f} s for the checkpoint's I/O"
                                          if extra >= 0.5 else "")
    phase = f"{e['phase']}, " if e.get("phase") and e["op"].startswith(IO_PREFIX) else ""
    lines = [f"hpctrain: STALL {step}{phase}{e['op']} #{seq} over {group}{size_txt} pending "
             f"{waited:.0f} s ({limit}) on ranks {entered}"
             + (("; ranks {} never entered it" if collective else
                 "; its peer ranks {} never answered").format(never) if never else "")]
    for r in silent:
        b = beats.get(r)
        if b is None:
            lines.append(f"  rank {r}: no record at all (never started, or no heartbeat)")
            continue
        last = mirrors.get(r) or (b.get("pending") or b.get("entries") or [None])[-1]
        what = describe(last) if last else "nothing"
        lines.append(f"  rank {r} (pid {b['pid']} on {b['host']}) did not respond (stopped, "
                     f"dead or busy outside communication); last recorded: {what}")
    if not silent:
        lines += _crossed_waits(beats, mirrors, responded, size)
    for r in responded:
        pend = beats[r].get("pending") or []
        lines.append(f"  rank {r}: pending " + ("; ".join(describe(p) for p in pend) or "nothing")
                     + f"; stack in {os.path.join(out_dir, f'stall-rank-{r}.txt')}")
    lines.append(f"  flight records: {out_dir}/flight-rank-R.json "
                 f"(python -m hpctrain trace flight {out_dir}); aborting the job")
    return "\n".join(lines)


def _crossed_waits(beats: dict, mirrors: dict, responded: list[int], size: int) -> list[str]:
    """Every rank is alive yet stuck: list each pending collective with the ranks of its group
    that never entered it. Two or more such ops mean the ranks diverged (a data-dependent
    collective skipped, or collectives issued in another order, on some rank)."""
    ops = {}
    for r in responded:
        for e in beats[r].get("pending") or []:
            if e.get("peer") is None:
                ops.setdefault((e["group"], e["seq"]), e)
    rows = []
    for (group, seq), e in sorted(ops.items(), key=lambda kv: kv[1]["start"]):
        members = _members(group, size)
        never = [r for r in members if r in beats and beats[r]["seqs"].get(group, 0) < seq
                 and not _entered(mirrors.get(r), group, seq)]
        if never:
            rows.append(f"    {e['op']} #{seq} over {group}: never entered by ranks {never}")
    if len(rows) < 2:
        return []
    return ["  the ranks wait in different collectives (one was skipped, or issued in another "
            "order, on some rank):", *rows]


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
    channel = None
    if rank == 0:
        base = out_dir or None
        if base:
            os.makedirs(base, exist_ok=True)
        _sweep_stale(base or tempfile.gettempdir())
        channel = tempfile.mkdtemp(prefix=CHANNEL_PREFIX, dir=base)
        with open(os.path.join(channel, "owner"), "w") as f:  # for a later _sweep_stale
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
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


CHANNEL_PREFIX = ".hpctrain-watchdog-"


def stall_dir_of(channel: str) -> str:
    """Where a job without out_dir gets its stall files: a visible folder beside the channel
    (made when a stall is reported), named after it."""
    parent, name = os.path.split(channel.rstrip(os.sep))
    return os.path.join(parent, "hpctrain-stall-" + name[len(CHANNEL_PREFIX):])


def _owners(path: str) -> list[tuple[str, int]]:
    """(host, pid) of a channel's processes: rank 0's ``owner`` file, else (a channel made
    before there was one) those its heartbeats name."""
    try:
        with open(os.path.join(path, "owner")) as f:
            host, pid = f.read().split()
        return [(host, int(pid))]
    except (OSError, ValueError):
        pass
    owners = []
    for name in os.listdir(path):
        if name.startswith("hb-") and name.endswith(".json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(path, name)) as f:
                    hb = json.load(f)
                owners.append((str(hb["host"]), int(hb["pid"])))
    return owners


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


def _sweep_stale(base: str) -> None:
    """Remove the channels that ended jobs left in base (rank 0, at start): a process killed
    by a signal (SIGKILL, an unhandled SIGTERM) or ended by os._exit runs no cleanup. A
    channel is stale when its processes (``_owners``) all ran on this host and are gone, or
    when nothing in it changed for STALE_CHANNEL_S (processes on another host, or none
    known): never a running job's."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(CHANNEL_PREFIX)]
    except OSError:
        return
    host = socket.gethostname()
    for name in names:
        path = os.path.join(base, name)
        try:
            owners = _owners(path)
            if owners and all(h == host for h, _ in owners):
                if any(_alive(pid) for _, pid in owners):
                    continue
            elif time.time() - max([os.stat(path).st_mtime] + [
                    os.stat(os.path.join(path, n)).st_mtime for n in os.listdir(path)]) \
                    < STALE_CHANNEL_S:
                continue
        except OSError:  # removed meanwhile, or not ours to read
            continue
        shutil.rmtree(path, ignore_errors=True)


#: A channel of another host untouched this long belongs to a job that ended.
STALE_CHANNEL_S = 24 * 3600
