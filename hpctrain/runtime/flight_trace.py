"""``python -m hpctrain trace flight DIR``: where the ranks' flight records diverge.

Reads ``DIR/flight-rank-R.json`` (written by the watchdog on a stall, runtime/watchdog.py) and,
for each group instance, finds the first collective sequence number not entered by every
member: the op the job stalled in and the ranks that never reached it. Ranks without a file
(stopped or dead when the others wrote theirs) are named as such; their last recorded op is in
the stall report, which the live ranks' heartbeats fed. Pure file reading: no MPI.
"""

from __future__ import annotations

import glob
import json
import os
import re

from hpctrain.runtime.flight import describe, members_of

__all__ = ["read_records", "divergences", "format_divergences"]


def read_records(directory: str) -> dict[int, dict]:
    """{rank: record} from every flight-rank-R.json in ``directory``."""
    records = {}
    for path in glob.glob(os.path.join(directory, "flight-rank-*.json")):
        m = re.search(r"flight-rank-(\d+)\.json$", path)
        if m:
            with open(path) as f:
                records[int(m.group(1))] = json.load(f)
    return records


_members = members_of


def divergences(records: dict[int, dict]) -> list[dict]:
    """One dict per collective group whose members did not all enter the same last op:
    group, seq (the first one not entered by every member), op (its entry, from a rank that
    entered it), entered, missing (members that did not), unknown (members without a record)."""
    if not records:
        return []
    size = max(r.get("size", 0) for r in records.values()) or max(records) + 1
    groups = sorted({g for r in records.values() for g in r["seqs"] if not g.endswith(":p2p")})
    out = []
    for g in groups:
        members = _members(g, size)
        known = [m for m in members if m in records]
        unknown = [m for m in members if m not in records]
        last = {m: records[m]["seqs"].get(g, 0) for m in known}
        top = max(last.values())
        first = min(last.values()) + 1
        if top < first and not unknown:
            continue  # every member entered every op: no divergence here
        if top < first:  # the known ranks agree; the unknown ones are suspects only if
            first = top  # the known ones still wait in that op
            if not any(p["group"] == g and p["seq"] == top
                       for m in known for p in records[m].get("pending") or []):
                continue
        entered = [m for m in known if last[m] >= first]
        entry = next((e for m in entered for e in records[m]["entries"]
                      if e["group"] == g and e["seq"] == first), None)
        out.append({"group": g, "seq": first, "op": entry, "entered": entered,
                    "missing": [m for m in known if last[m] < first], "unknown": unknown,
                    "last": {m: _last_in(records[m], g) for m in known if last[m] < first}})
    return out


def _p2p_waits(records: dict[int, dict]) -> list[str]:
    """Pending point-to-point ops whose peer left no record (p2p sequence numbers differ
    between peers, so the peer's absence is what can be said)."""
    size = max(r.get("size", 0) for r in records.values()) or max(records) + 1
    lines = []
    for r, rec in sorted(records.items()):
        for p in rec.get("pending") or []:
            if p.get("peer") is None:
                continue
            members = members_of(p["group"], size)
            peers = p["peer"] if isinstance(p["peer"], list) else [p["peer"]]
            gone = sorted({members[q] if q < len(members) else q for q in peers} - set(records))
            if gone:
                lines.append(f"divergence in {p['group']} (point-to-point): rank {r} waits in "
                             f"{describe(p)}; no record from ranks {gone} (stopped or dead?)")
    return lines


def _last_in(record: dict, group: str) -> dict | None:
    return next((e for e in reversed(record["entries"]) if e["group"] == group), None)


def format_divergences(directory: str) -> tuple[str, int]:
    """The printed answer and an exit code (0: found records; 1: none)."""
    records = read_records(directory)
    if not records:
        return f"no flight-rank-R.json in {directory}", 1
    lines = [f"flight records of ranks {sorted(records)} in {directory}"]
    for r, rec in sorted(records.items()):
        pend = rec.get("pending") or []
        lines.append(f"  rank {r}: {len(rec['entries'])} ops recorded; pending: "
                     + ("; ".join(describe(p) for p in pend) or "none"))
    divs = divergences(records)
    p2p = _p2p_waits(records)
    lines += p2p
    if not divs and not p2p:
        lines.append("no divergence: every rank of every group entered the same collectives")
    for d in divs:
        what = describe(d["op"]) if d["op"] else f"#{d['seq']}"
        lines.append(f"divergence in {d['group']} at #{d['seq']}: {what}")
        lines.append(f"  entered by ranks {d['entered']}"
                     + (f"; not entered by ranks {d['missing']}" if d["missing"] else "")
                     + (f"; no record from ranks {d['unknown']} (stopped or dead?)"
                        if d["unknown"] else ""))
        for m, e in d["last"].items():
            lines.append(f"  rank {m} last in {d['group']}: {describe(e) if e else 'nothing'}")
    return "\n".join(lines), 0
