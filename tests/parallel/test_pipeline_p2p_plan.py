"""The pipeline's p2p plans (pure, no MPI): every message is sent once and received once, and
the ordered plan (what NCCL runs) neither hangs nor pairs the wrong messages under NCCL's
rules, for every schedule at every size; the replay catches the orders that would."""

from collections import Counter

import pytest

from hpctrain.parallel.pipeline import p2p_plan as pp
from hpctrain.parallel.pipeline import schedule as sched


def _configs(max_p=6, max_m=16):
    for name in sched.SCHEDULES:
        for p in range(1, max_p + 1):
            for v in ((1,) if name != "interleaved-1f1b" else (2, 3)):
                for m in range(1, max_m + 1):
                    if name == "interleaved-1f1b" and m % p:
                        continue
                    yield name, p, v, m


@pytest.mark.parametrize("ordered", [False, True], ids=["eager", "ordered"])
def test_every_message_is_sent_once_and_received_once(ordered):
    for name, p, v, m in _configs():
        sent, got = Counter(), Counter()
        for r, acts in enumerate(sched.build(name, p, m, v)):
            steps = pp.plan(acts, r, p, v, ordered)
            posted_recvs = Counter(msg for st in steps for msg in st.pre_recvs)
            own_recvs = Counter(st.recv for st in steps if st.recv is not None)
            assert posted_recvs == own_recvs, (name, p, v, m, r)
            own_sends = Counter(st.send for st in steps if st.send is not None)
            posted = Counter(msg for st in steps for msg in st.pre_sends + st.post_sends)
            assert posted == own_sends, (name, p, v, m, r)
            # a message is posted after the action that makes it, and received by the
            # time the action that needs it runs
            seen = set()
            for st in steps:
                assert all(msg in seen for msg in st.pre_sends), (name, p, v, m, r)
                if st.send is not None:
                    seen.add(st.send)
                assert all(msg in seen for msg in st.post_sends), (name, p, v, m, r)
            sent.update(own_sends)
            got.update(own_recvs)
        assert sent == got and all(c == 1 for c in sent.values()), (name, p, v, m)


def test_ordered_plans_are_safe_under_nccl_rules():
    count = 0
    for name, p, v, m in _configs(max_p=8, max_m=24):
        sched_ = sched.build(name, p, m, v)
        pp.check_ordered(sched_, v)
        count += 1
    assert count > 400


def test_eager_order_would_hang_on_nccl():
    # 1F1B's steady state: both neighbours send first, then receive. Fine with MPI's
    # non-blocking sends; with NCCL's blocking ones (no group) it hangs, and the replay says so.
    schedules = sched.build("1f1b", 2, 4)
    plans = [pp.plan(a, r, 2, 1, ordered=False) for r, a in enumerate(schedules)]
    with pytest.raises(ValueError, match="deadlock"):
        pp._replay([pp._groups(pl, headers=False) for pl in plans], 2)


def test_interleaved_needs_its_steady_pairs_grouped(monkeypatch):
    # Per-action groups (1F1B's rule) deadlock for interleaved 1F1B: the (F, B) pairs of
    # the steady state must share one group, as Megatron-LM posts them.
    schedules = sched.build("interleaved-1f1b", 2, 8, 2)
    pp.check_ordered(schedules, 2)
    monkeypatch.setattr(pp, "_units", lambda actions, v: [[i] for i in range(len(actions))])
    with pytest.raises(ValueError, match="deadlock"):
        pp.check_ordered(schedules, 2)


def test_replay_catches_messages_paired_out_of_order():
    # NCCL matches the k-th send with the k-th receive: a receiver that takes two messages
    # of one direction in the other order would get the wrong tensors (MPI tags would hide it).
    schedules = sched.build("gpipe", 2, 2)
    plans = [pp.plan(a, r, 2, 1, ordered=True) for r, a in enumerate(schedules)]
    groups = [pp._groups(pl, headers=False) for pl in plans]
    recv_groups = [i for i, g in enumerate(groups[1]) if g[-1][1].kind == "act"]
    a, b = recv_groups[:2]
    groups[1][a], groups[1][b] = groups[1][b], groups[1][a]
    with pytest.raises(ValueError, match="would meet"):
        pp._replay(groups, 2)


def test_ordered_groups_carry_the_shape_header_first():
    schedules = sched.build("1f1b", 2, 2)
    first = pp._groups(pp.plan(schedules[1], 1, 2, 1, ordered=True), headers=True)
    # stage 1 takes boundary 0's header in a group of its own, then the activation
    assert first[0] == [("recv", pp.Msg("hdr", 0, 0))]
    assert first[1] == [("recv", pp.Msg("act", 0, 0))]
    later = pp._groups(pp.plan(schedules[1], 1, 2, 1, ordered=True), headers=False)
    assert all(m.kind != "hdr" for g in later for _, m in g)


def test_forward_only_evaluation_runs_cannot_hang():
    # evaluation's schedule (forwards only, chunk by chunk): every activation sent once and
    # received once, and the ordered (NCCL) issue order is safe at every size
    for p in range(1, 7):
        for v in (1, 2, 3):
            for m in range(1, 9):
                schedules = [sched.forward_only(p, m, v, r) for r in range(p)]
                pp.check_ordered(schedules, v)
                sched.simulate(schedules, v)
                assert all(len(s) == m * v for s in schedules)
