"""The one stall report: which op stalled, on which ranks, and who never entered it.

The watchdog's reporter (watchdog.py) composes it from the channel: the request of the rank
that saw the stall first, every rank's heartbeat (pending ops, sequence numbers per group)
and mirror (its very last op, exact even for a stopped rank). ``io_allowance_s`` is the time
a checkpoint step may take beyond the timeout: the watchdog waits it out, the report states it.
"""

from __future__ import annotations

import json
import os
import time

from hpctrain.runtime.flight import IO_PREFIX, describe, members_of, read_mirror
from hpctrain.runtime.watchdog_channel import REQUEST, heartbeat_path, mirror_path
from hpctrain.units import human_bytes

__all__ = ["compose_report", "io_allowance_s"]

# A checkpoint step (an op named ckpt_*, its bytes the file's) may wait while another rank
# writes: on top of the timeout, the time the whole file takes at this floor of a parallel
# file system's speed (20 MB/s: 1 GB adds 50 s). A save that has not ended by then is stuck.
IO_FLOOR_BPS = 20e6


def io_allowance_s(op: str, nbytes) -> float:
    """Seconds an op may take beyond the timeout: the I/O of a checkpoint step, else none."""
    return (nbytes or 0) / IO_FLOOR_BPS if op.startswith(IO_PREFIX) else 0.0


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
            members = members_of(e["group"], size)
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
            with open(heartbeat_path(channel, r)) as f:
                beats[r] = json.load(f)
        except (OSError, ValueError):
            pass
    return beats


def compose_report(channel: str, size: int, timeout_s: float, out_dir: str) -> str:
    """The one stall report, from the request and every rank's heartbeat."""
    with open(os.path.join(channel, REQUEST)) as f:
        req = json.load(f)
    beats = _load_heartbeats(channel, size)
    # A silent rank's heartbeat can be a poll old; its mirror holds its very last op.
    mirrors = {r: read_mirror(mirror_path(channel, r)) for r in range(size)}
    responded = sorted(r for r, b in beats.items() if b.get("responded"))
    owner, e = _culprit_op(req, beats, responded, size)
    group, seq = e["group"], e["seq"]
    collective = e.get("peer") is None
    members = members_of(group, size)
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
        members = members_of(group, size)
        never = [r for r in members if r in beats and beats[r]["seqs"].get(group, 0) < seq
                 and not _entered(mirrors.get(r), group, seq)]
        if never:
            rows.append(f"    {e['op']} #{seq} over {group}: never entered by ranks {never}")
    if len(rows) < 2:
        return []
    return ["  the ranks wait in different collectives (one was skipped, or issued in another "
            "order, on some rank):", *rows]
