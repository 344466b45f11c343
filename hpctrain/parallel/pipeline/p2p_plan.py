"""Which message each action of a schedule receives and sends, and how sends are grouped.

Two issue orders (``StageLinks.ordered``):

* eager (MPI/gloo on CPU): an action receives its input, computes, and posts its output
  as a non-blocking send at once. MPI tags keep the kinds of message apart, and a send
  never blocks the issuing rank, so any order of actions is safe.
* ordered (NCCL): NCCL has no tags -- the k-th send from rank A to rank B meets the k-th
  receive on B from A -- and a send blocks until that receive runs, unless the two are in
  one ncclGroup. In 1F1B's steady state both neighbours send first and then receive
  (stage 0 sends activation i+1 and waits for gradient i; stage 1 sends gradient i and
  waits for activation i+1), which deadlocks. So, as Megatron-LM does, an action's send is
  deferred and posted in one group with the next action's receive (``pre_sends``); it goes
  alone right after the compute only when the next action receives nothing.

``check_ordered`` replays the ordered groups of every rank with NCCL's rules (in-order
matching per direction, blocking groups, one stream per rank) and raises if a schedule
would pair the wrong messages or hang; tests run it over every schedule and size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpctrain.parallel.pipeline.schedule import Action, stage_of

__all__ = ["Msg", "Step", "plan", "check_ordered"]


@dataclass(frozen=True)
class Msg:
    """One tensor crossing boundary ``boundary`` (between stage b and b+1) for micro-batch
    ``mb``: an activation ("act", forward) or its gradient ("grad", backward); "hdr" is the
    shape header sent once ahead of a boundary's first activation."""

    kind: str
    boundary: int
    mb: int

    def src_stage(self) -> int:
        return self.boundary + 1 if self.kind == "grad" else self.boundary

    def dst_stage(self) -> int:
        return self.boundary if self.kind == "grad" else self.boundary + 1


@dataclass
class Step:
    """One action with its messages: post ``pre_sends`` and ``pre_recvs`` together, compute
    (consuming ``recv``), then post ``post_sends``. In eager mode ``pre_recvs`` is the
    action's own receive and ``post_sends`` its own send."""

    action: Action
    stage: int
    recv: Msg | None
    send: Msg | None
    pre_sends: list = field(default_factory=list)
    pre_recvs: list = field(default_factory=list)
    post_sends: list = field(default_factory=list)


def _recv_of(a: Action, g: int, S: int) -> Msg | None:
    if a.op == "F":
        return Msg("act", g - 1, a.mb) if g > 0 else None
    return Msg("grad", g, a.mb) if g < S - 1 else None


def _send_of(a: Action, g: int, S: int) -> Msg | None:
    if a.op == "F":
        return Msg("act", g, a.mb) if g < S - 1 else None
    return Msg("grad", g - 1, a.mb) if g > 0 else None


def _units(actions: list[Action], v: int) -> list[list[int]]:
    """Action indices that share one group of receives. Interleaved ranks with a steady
    state (a backward followed by a forward) take each steady (F, B) pair as one unit, as
    Megatron-LM's interleaved schedule does: per-action groups deadlock there (a chunk's
    gradient send waits on a neighbour blocked in the next chunk's receive)."""
    ops = "".join(a.op for a in actions)
    pairs = v > 1 and "BF" in ops
    units, i = [], 0
    while i < len(actions):
        if pairs and i + 1 < len(actions) and ops[i:i + 2] == "FB":
            units.append([i, i + 1])
            i += 2
        else:
            units.append([i])
            i += 1
    return units


def plan(actions: list[Action], rank: int, p: int, v: int, ordered: bool) -> list[Step]:
    """The Steps of ``rank`` running ``actions`` (p ranks, v chunks each)."""
    S = p * v
    steps = []
    for a in actions:
        g = stage_of(rank, a.chunk, p)
        steps.append(Step(a, g, _recv_of(a, g, S), _send_of(a, g, S)))
    if not ordered:
        for st in steps:
            st.pre_recvs = [st.recv] if st.recv is not None else []
            st.post_sends = [st.send] if st.send is not None else []
        return steps
    units = _units(actions, v)
    deferred: list = []
    for k, unit in enumerate(units):
        first = steps[unit[0]]
        first.pre_recvs = [steps[i].recv for i in unit if steps[i].recv is not None]
        first.pre_sends, deferred = deferred, []  # with the unit's receives, if it has any
        deferred += [steps[i].send for i in unit if steps[i].send is not None]
        later = units[k + 1] if k + 1 < len(units) else []
        if deferred and not any(steps[i].recv is not None for i in later):
            steps[unit[-1]].post_sends, deferred = deferred, []
    return steps


def _groups(steps: list[Step], headers: bool) -> list[list[tuple]]:
    """One rank's ordered-mode p2p groups: lists of ("send"|"recv", Msg), in issue order
    (what ``StageLinks.post`` posts). With ``headers`` (a run's first step) a boundary's
    first activation is preceded by its shape header; the receiver takes the headers in the
    group and the data in a group of its own (it needs the shape to allocate the buffer)."""
    sent, got, out = set(), set(), []

    def sends(msgs):
        ops = []
        for m in msgs:
            if headers and m.kind == "act" and m.boundary not in sent:
                sent.add(m.boundary)
                ops.append(("send", Msg("hdr", m.boundary, m.mb)))
            ops.append(("send", m))
        return ops

    for st in steps:
        group = sends(st.pre_sends)
        new = [r for r in st.pre_recvs if headers and r.kind == "act" and r.boundary not in got]
        if new:
            got.update(r.boundary for r in new)
            out.append(group + [("recv", Msg("hdr", r.boundary, r.mb)) for r in new])
            group = []
        group += [("recv", r) for r in st.pre_recvs]
        if group:
            out.append(group)
        if st.post_sends:
            out.append(sends(st.post_sends))
    return out


def check_ordered(schedules: list[list[Action]], v: int = 1) -> None:
    """Raise ValueError if the ordered issue order of ``schedules`` (one list per rank) would
    pair messages wrongly or deadlock under NCCL's rules; checks a run's first step (with
    shape headers) and the later ones (without)."""
    p = len(schedules)
    plans = [plan(acts, r, p, v, ordered=True) for r, acts in enumerate(schedules)]
    for headers in (True, False):
        _replay([_groups(pl, headers) for pl in plans], p)


def _replay(groups: list[list[list[tuple]]], p: int) -> None:
    """Rendezvous replay: a rank's head group completes once every op in it has met its
    partner in the partner rank's head group; the k-th send A->B meets the k-th recv on B
    from A, and both must name the same message (NCCL matches by order, not by tag)."""
    ops = {}                                  # (rank, group, slot) -> (op, msg, peer)
    seq: dict[tuple, list] = {}               # (op, src, dst) -> [(rank, group, slot)]
    for r, gs in enumerate(groups):
        for gi, group in enumerate(gs):
            for k, (op, msg) in enumerate(group):
                peer = (msg.dst_stage() if op == "send" else msg.src_stage()) % p
                if peer == r:
                    continue                  # same rank (p=1): a local copy, no message
                ops[(r, gi, k)] = (op, msg, peer)
                key = (op, r, peer) if op == "send" else (op, peer, r)
                seq.setdefault(key, []).append((r, gi, k))
    partner = {}
    for (op, src, dst), slots in seq.items():
        if op != "send":
            continue
        recvs = seq.get(("recv", src, dst), [])
        if len(recvs) != len(slots):
            raise ValueError(f"rank {src} sends {len(slots)} messages to rank {dst}, which "
                             f"receives {len(recvs)}")
        for s, t in zip(slots, recvs):
            if ops[s][1] != ops[t][1]:
                raise ValueError(f"rank {src}'s send of {ops[s][1]} would meet rank {dst}'s "
                                 f"receive of {ops[t][1]} (NCCL matches by order, not tag)")
            partner[s], partner[t] = t, s
    head = [0] * p
    done = set()
    while True:
        moved = False
        for r in range(p):
            while head[r] < len(groups[r]):
                gi = head[r]
                for k in range(len(groups[r][gi])):
                    s = (r, gi, k)
                    if s in ops and s not in done and head[partner[s][0]] == partner[s][1]:
                        done.update((s, partner[s]))
                if any(s in ops and s not in done
                       for s in ((r, gi, k) for k in range(len(groups[r][gi])))):
                    break
                head[r] += 1
                moved = True
        if all(head[r] == len(groups[r]) for r in range(p)):
            return
        if not moved:
            stuck = {r: groups[r][head[r]] for r in range(p) if head[r] < len(groups[r])}
            raise ValueError(f"ordered p2p groups deadlock: ranks wait at {stuck}")
