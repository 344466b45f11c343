"""Pipeline schedules, stage splits and layer stacks: pure, no MPI."""

import pytest
import torch

from hpctrain.models import gpt, mlp
from hpctrain.parallel.pipeline import plan, schedule as sched

GRID = [(p, m) for p in (2, 4) for m in (4, 8, 12)]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                    ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("p,m", GRID)
def test_every_schedule_is_complete_and_deadlock_free(name, v, p, m):
    if name == "interleaved-1f1b" and m % p:
        pytest.skip("interleaved needs m % p == 0")
    per_rank = sched.build(name, p, m, v)
    for acts in per_rank:
        for op in "FB":
            got = sorted((a.mb, a.chunk) for a in acts if a.op == op)
            assert got == sorted((i, c) for i in range(m) for c in range(v))
        # Each chunk's forwards and backwards go in micro-batch order: one tag per boundary
        # then delivers messages in the order they are needed.
        for c in range(v):
            for op in "FB":
                mbs = [a.mb for a in acts if a.op == op and a.chunk == c]
                assert mbs == sorted(mbs)
    sched.simulate(per_rank, v)  # raises if any rank would wait forever


@pytest.mark.parametrize("p,m", GRID)
def test_activation_count_1f1b_at_most_p_gpipe_m(p, m):
    gp = [sched.peak_live(a) for a in sched.build("gpipe", p, m)]
    ofob = [sched.peak_live(a) for a in sched.build("1f1b", p, m)]
    assert gp == [m] * p
    assert max(ofob) <= p and ofob[0] == min(p, m)
    assert ofob == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                    ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_ideal_bubble_equals_formula(name, v, p, m):
    # t_b = 2 t_f (backward costs twice the forward), no communication cost.
    got = sched.simulate(sched.build(name, p, m, v), v, 1.0, 2.0)["bubble"]
    want = sched.bubble_formula(p, m, v)
    assert got == pytest.approx([want] * p, abs=1e-12)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_simulate_with_per_action_costs(name, v):
    # A constant cost function reproduces the scalar costs (and the formula) ...
    acts = sched.build(name, 2, 4, v)
    const = sched.simulate(acts, v, cost=lambda op, mb, g: 1.0 if op == "F" else 2.0)
    assert const == sched.simulate(acts, v, 1.0, 2.0)
    # ... and a slower stage makes the mean bubble exceed the formula (the bench reports it as
    # stage imbalance).
    slow = sched.simulate(acts, v, cost=lambda op, mb, g: (1.0 if op == "F" else 2.0) *
                          (1.5 if g == 1 else 1.0))
    assert sum(slow["bubble"]) / 2 > sched.bubble_formula(2, 4, v)


def test_simulate_gpipe_makespan_with_a_slow_last_stage():
    # p=2: stage 1 (f1, b1) slower than stage 0 (f0, b0): stage 1 runs back to back after
    # stage 0's first forward, and stage 0's last backward follows: f0 + m(f1 + b1) + b0.
    f, b, m = [1.0, 1.5], [2.0, 3.5], 6
    got = sched.simulate(sched.build("gpipe", 2, m), 1,
                         cost=lambda op, mb, g: f[g] if op == "F" else b[g])
    assert got["makespan"] == pytest.approx(f[0] + m * (f[1] + b[1]) + b[0])
    assert got["busy"] == pytest.approx([m * (f[0] + b[0]), m * (f[1] + b[1])])


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of the pipeline depth"):
        sched.build("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        sched.build("zigzag", 2, 4)


def test_balanced_split_with_costs_measured_per_rank():
    # Identical layers, rank 1 twice as slow: it gets half as many layers.
    assert plan.balanced_split([[1.0] * 6, [2.0] * 6], 2) == [0, 4]
    assert plan.balanced_split([[2.0] * 6, [1.0] * 6], 2) == [0, 2]
    # Equal ranks: the same split as one shared cost list.
    assert plan.balanced_split([[5, 1, 1, 1, 1, 1]] * 2, 2) == plan.balanced_split(
        [5, 1, 1, 1, 1, 1], 2)
    # Interleaved placement: stage s runs on rank s % p (p=2, 4 stages).
    assert plan.balanced_split([[1.0] * 12, [2.0] * 12], 4) == [0, 4, 6, 10]


def test_balanced_split_minimises_the_largest_stage():
    assert plan.balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert plan.balanced_split([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert plan.balanced_split([1] * 10, 4) in ([0, 3, 6, 8], [0, 2, 5, 8], [0, 3, 5, 8],
                                                 [0, 2, 4, 7], [0, 3, 6, 9])
    starts = plan.balanced_split([3, 1, 4, 1, 5, 9, 2, 6], 3)
    groups = plan.stage_layers(starts, 8)
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][i] for i in g) for g in groups) == 14
    assert all(groups)


def test_split_points_by_index_or_name():
    names = ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert plan.split_at("2,blocks.2", names, 3) == [0, 2, 3]
    with pytest.raises(ValueError, match="gives 2 stages but"):
        plan.split_at("2", names, 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        plan.split_at("3,2", names, 3)
    with pytest.raises(ValueError, match="neither a layer index nor a layer name"):
        plan.split_at("blocks.9", names, 2)


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="pp=8 stages but the model has only 5 layers"):
        plan.check_fits(5, 8, 1, "1f1b")
    with pytest.raises(ValueError, match="interleaved-1f1b with pp=4 and pipeline.virtual_stages=2"):
        plan.check_fits(5, 4, 2, "interleaved-1f1b")
    plan.check_fits(8, 4, 2, "interleaved-1f1b")


@pytest.mark.parametrize("mod,opts", [(gpt, {"layers": 3}), (mlp, {"layers": 4})])
def test_stage_builds_exactly_the_whole_models_weights(mod, opts):
    whole, _, _ = mod.factory(3, **opts)
    stack, _, _ = mod.pipeline(3, **opts)
    ref = whole.state_dict()
    n = len(stack)
    for owned in ([0], [0, 1], list(range(1, n)), [n - 1], list(range(n))):
        part = stack.build(owned)
        for key, t in part.state_dict().items():
            assert torch.equal(t, ref[key]), key
    counts = stack.param_counts()
    tied = sum(p.numel() for k, p in whole.named_parameters(remove_duplicate=False)
               if k in stack.tied)
    assert sum(counts) == sum(p.numel() for p in whole.parameters()) + tied


def test_stage_chain_computes_the_whole_forward():
    whole, data, _ = gpt.factory(0, layers=2)
    stack, _, _ = gpt.pipeline(0, layers=2)
    x = torch.stack([data[i][0] for i in range(3)])
    roots = [stack.build([0, 1]), stack.build([2, 3])]
    h = x
    for root, idx in zip(roots, ([0, 1], [2, 3])):
        for i in idx:
            h = stack.layers[i].forward(root, h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=0)
    # Tied: the head stage holds its own copy of the embedding, equal at init.
    assert not any(p is roots[1].head.weight for p in roots[0].parameters())
    assert torch.equal(roots[1].head.weight, roots[0].tok_emb.weight)


def test_simulate_latency_delays_only_messages_between_ranks():
    # GPipe p=2: the first activation and the last gradient cross the boundary on the
    # critical path, every other message arrives while its receiver is still busy.
    acts, L = sched.build("gpipe", 2, 6), 0.25
    free = sched.simulate(acts, 1, 1.0, 2.0)["makespan"]
    assert sched.simulate(acts, 1, 1.0, 2.0, latency=L)["makespan"] == pytest.approx(free + 2 * L)
    # One rank holds every stage: nothing crosses a rank, so latency changes nothing.
    one = sched.build("interleaved-1f1b", 1, 4, 2)
    assert sched.simulate(one, 2, latency=L) == sched.simulate(one, 2)


def test_measured_balance_counts_the_loss_on_the_last_layer():
    # Four cheap identical layers and a loss that costs 50 ms: timed with the loss, the last
    # layer is the heaviest, so the last stage gets it alone; without it, an even split.
    import time
    from types import SimpleNamespace

    from hpctrain.models.layers import from_sequential
    from hpctrain.parallel.pipeline.transform import Probe, _layer_costs

    def slow_loss(out, target):
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            pass
        return torch.nn.functional.mse_loss(out, target)

    stack = from_sequential(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]))
    one = SimpleNamespace(size=1, device=torch.device("cpu"))  # a pp / dp of one rank
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    probe = Probe(sample=x, target=y, loss_fn=slow_loss)
    costs = _layer_costs(stack, "measured", probe, one, one)[0]
    assert costs[-1] >= 0.05 and max(costs[:-1]) < 0.02, costs
    assert plan.balanced_split(costs, 2) == [0, 3]
    plain = _layer_costs(stack, "measured", Probe(sample=x), one, one)[0]
    assert max(plain) < 0.02, plain  # no loss in the last layer's time
