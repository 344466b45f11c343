"""The watchdog's channel: a per-job directory through which the ranks' watchdogs talk.

Not a communicator: it keeps working when a rank is stopped (SIGSTOP) or dead, and needs no
MPI call while the stuck op is still in progress. Rank 0 makes it at start (``make_channel``,
which first sweeps the channels that ended jobs left: ``sweep_stale``); each rank writes its
heartbeat (``heartbeat_path``) and mirrors its last op (``mirror_path``) into it; the rank
that sees a stall creates ``REQUEST``, and the reporter claims ``REPORT``. It is working
state, removed (``remove_channel``) on every end a process can act on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time

__all__ = ["CHANNEL_PREFIX", "REPORT", "REQUEST", "STALE_CHANNEL_S", "heartbeat_path",
           "make_channel", "mirror_path", "remove_channel", "stall_dir_of", "sweep_stale"]

CHANNEL_PREFIX = ".hpctrain-watchdog-"
#: A channel of another host untouched this long belongs to a job that ended.
STALE_CHANNEL_S = 24 * 3600
REQUEST = "request"  # created (O_EXCL) by the first rank to see a stall: every rank reports
REPORT = "report"    # claimed (O_EXCL) by the one rank that writes the report


def heartbeat_path(channel: str, rank: int) -> str:
    """The rank's heartbeat: a snapshot of its flight record, rewritten as it changes."""
    return os.path.join(channel, f"hb-{rank}.json")


def mirror_path(channel: str, rank: int) -> str:
    """The memory-mapped mirror of the rank's last op (exact, written on every op)."""
    return os.path.join(channel, f"last-{rank}.bin")


def make_channel(base: str | None) -> str:
    """Rank 0's new channel under ``base`` (None: the system temp dir), after sweeping the
    stale ones there; an ``owner`` file names this process for a later sweep."""
    if base:
        os.makedirs(base, exist_ok=True)
    sweep_stale(base or tempfile.gettempdir())
    channel = tempfile.mkdtemp(prefix=CHANNEL_PREFIX, dir=base)
    with open(os.path.join(channel, "owner"), "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return channel


def remove_channel(channel: str) -> None:
    """Remove the channel while other ranks may still write into it: renamed first (one
    atomic step), so that a rank's late file (a heartbeat, a 'report' claim) fails to find
    the directory instead of landing in one being emptied (and keeping it)."""
    gone = f"{channel}.gone{os.getpid()}"
    try:
        os.rename(channel, gone)
    except OSError:
        return  # removed (or being removed) by another rank
    shutil.rmtree(gone, ignore_errors=True)


def stall_dir_of(channel: str) -> str:
    """Where a job without out_dir gets its stall files: a visible folder beside the channel
    (made when a stall is reported), named after it."""
    parent, name = os.path.split(channel.rstrip(os.sep))
    return os.path.join(parent, "hpctrain-stall-" + name[len(CHANNEL_PREFIX):])


def _owners(path: str) -> list[tuple[str, int]]:
    """(host, pid) of a channel's processes: rank 0's ``owner`` file, else (a channel
    without one) those its heartbeats name."""
    try:
        with open(os.path.join(path, "owner")) as f:
            host, pid = f.read().split()
        return [(host, int(pid))]
    except (OSError, ValueError):
        pass
    owners = []
    for name in os.listdir(path):
        if name.startswith("hb-") and name.endswith(".json"):  # heartbeat_path's files
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


def sweep_stale(base: str) -> None:
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

