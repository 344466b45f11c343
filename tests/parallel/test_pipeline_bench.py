"""`hpctrain bench pipeline` runs end to end at 2 ranks on a tiny model."""

import time

import pytest
import torch

from hpctrain.bench import timed_layer
from hpctrain.bench.timed_layer import TailClock, TimedLayer, timed_mse_loss, wait_until
from hpctrain.parallel.pipeline.schedule import bubble_formula
from tests.mpirun import run_mpi

BASE = ["-m", "hpctrain", "bench", "pipeline", "--pp", "2", "--microbatches", "2,4", "--steps",
        "1", "--warmup", "1", "--layers", "4", "--width", "64", "--micro-batch", "8"]
NAMES = ("gpipe", "1f1b", "interleaved-1f1b")


def _rows(out: str, waits):
    """The table's rows and the per-stage ms rows, checked against the columns' meanings."""
    assert "crosses a stage boundary in" in out, out
    assert "when sent right after a compute of" in out, out
    main, _, compute = out.partition("compute per micro-batch, median ms")
    rows = [ln.split() for ln in main.splitlines() if ln.strip().split(" ")[0] in NAMES]
    # gpipe, 1f1b and interleaved (v=2) at m=2,4, once per wait policy
    want = sorted((s, m, w) for s in NAMES for m in (2, 4) for w in waits)
    assert sorted((r[0], int(r[2]), r[4]) for r in rows) == want, out
    for r in rows:
        p, m, v = int(r[1]), int(r[2]), int(r[3])
        stages = [float(x) for x in r[5:5 + p]]
        mean, formula, ratio, sim, vs_sim, imbal, jitter, hop, comm, over, ours = map(
            float, r[5 + p:16 + p])
        assert all(0.0 <= b < 1.0 for b in stages), r
        assert formula == pytest.approx(bubble_formula(p, m, v), abs=5e-4), r
        assert ratio == pytest.approx(mean / formula, abs=0.02), r
        assert 0.0 <= sim < 1.0 and imbal == pytest.approx(sim - formula, abs=2e-3), r
        assert vs_sim == pytest.approx(mean / sim, abs=0.02) if sim > 0.01 else vs_sim >= 0, r
        # the four parts add up to the excess of the measured bubble over the formula; a
        # message time can only lengthen the simulated schedule
        assert imbal + jitter + hop + comm == pytest.approx(mean - formula, abs=3e-3), r
        assert hop >= 0.0, r
        assert 0.0 <= over < 1.0 and ours > 0  # samples/s
    # measured forward/backward ms of every stage (p*v of them) for each row
    cells = [ln.split() for ln in compute.splitlines() if ln.strip().split(" ")[0] in NAMES]
    assert sorted((c[0], int(c[2]), c[4]) for c in cells) == want, out
    for c in cells:
        times = [float(t) for cell in c[5:] for t in cell.split("/")]
        assert len(times) == 2 * int(c[1]) * int(c[3]) and all(t > 0 for t in times), c
    return rows, cells


@pytest.mark.mpi
def test_bench_pipeline_prints_bubble_table():
    proc = run_mpi(2, BASE + ["--wait", "spin,sleep"], timeout=240)
    out = proc.stdout
    assert "pipeline bench: 2 ranks" in out and "load average" in out, out + proc.stderr
    assert "4 x Linear(64)+GELU" in out, out
    rows, _ = _rows(out, ("spin", "sleep"))
    bad = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--wait", "busy"], timeout=60,
                  check=False)  # a bad policy: one clear error, before any MPI work
    assert bad.returncode != 0 and "--wait busy is not one of spin, yield, sleep" in bad.stderr
    # torch pipelining either ran (numbers in the last columns) or the reason is printed.
    assert all(r[-1] != "-" for r in rows) or "comparison did not run:" in out, out


@pytest.mark.mpi
def test_bench_pipeline_timed_model():
    # with the ordered (NCCL) issue order: grouped messages, synchronous MPI sends; layers
    # that sleep, as a GPU stage's host does
    proc = run_mpi(2, BASE + ["--model", "timed", "--layer-ms", "0.2", "--no-torch",
                              "--p2p", "ordered", "--layer-sleep"], timeout=240)
    out = proc.stdout
    assert "4 x timed layer (0.20 ms fwd / 0.40 ms bwd, width 64, sleeping; the last one's " \
           "time includes the loss)" in out, out + proc.stderr
    assert "p2p ordered" in out, out
    _, cells = _rows(out, ("sleep",))
    for c in cells:  # each stage (chunk) runs 4/(p*v) layers: at least their set time
        per = 4 // (int(c[1]) * int(c[3]))
        for cell in c[5:]:
            fwd, bwd = map(float, cell.split("/"))
            assert fwd >= 0.2 * per and bwd >= 0.4 * per, c
    bad = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--model", "conv"], timeout=60,
                  check=False)  # one clear error, before any MPI work
    assert bad.returncode != 0 and "--model conv is not one of linear, timed" in bad.stderr
    bad = run_mpi(2, ["-m", "hpctrain", "bench", "pipeline", "--layer-sleep"], timeout=60,
                  check=False)
    assert bad.returncode != 0 and "--layer-sleep needs --model timed" in bad.stderr


def test_timed_layer_takes_its_time_and_computes_x_times_scale():
    layer = TimedLayer(6, 0.004)
    with torch.no_grad():
        layer.scale.mul_(torch.arange(1.0, 7.0))
    x = torch.randn(3, 6, requires_grad=True)
    g = torch.randn(3, 6)
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.backward(g)
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.004 and t2 - t1 >= 0.008
    assert torch.equal(y, x.detach() * layer.scale.detach())
    assert torch.allclose(x.grad, g * layer.scale.detach())
    assert torch.allclose(layer.scale.grad, (g * x.detach()).sum(0))


def test_timed_layer_sleeping_takes_its_time():
    layer = TimedLayer(6, 0.004, sleep=True)
    x = torch.randn(3, 6, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.sum().backward()
    assert t1 - t0 >= 0.004 and time.perf_counter() - t1 >= 0.008
    deadline = time.perf_counter() + 0.003
    wait_until(deadline, sleep=True)
    assert time.perf_counter() >= deadline


def test_last_timed_layer_and_loss_share_the_layer_time(monkeypatch):
    # Record every wait as (who, deadline); the clock is perf_counter, so compare deadlines
    # with the start times the layer and the loss recorded.
    waits = []
    monkeypatch.setattr(timed_layer, "wait_until", lambda d, sleep=False: waits.append(d))
    clock = TailClock()
    tail, inner = TimedLayer(4, 0.5, tail=clock), TimedLayer(4, 0.5)
    loss_fn = timed_mse_loss(clock, 0.5)
    x, target = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    t0 = time.perf_counter()
    out = tail(inner(x))
    assert len(waits) == 1  # the inner layer waited; the tail layer left its time to the loss
    start = clock.forward_start
    assert t0 <= start <= time.perf_counter()
    loss = loss_fn(out, target)
    assert waits[1] == start + 0.5 and clock.forward_start is None
    t1 = time.perf_counter()
    loss.backward()
    # backward: the tail layer waits 2 x its time from the start of the loss's backward, the
    # inner layer from its own start
    assert len(waits) == 4 and t1 + 1.0 <= waits[2] <= time.perf_counter() + 1.0
    assert clock.backward_start is None and waits[3] >= waits[2]
    # the arithmetic is the plain MSE of the plain layers
    x2 = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.mse_loss(x2 * inner.scale.detach() * tail.scale.detach(), target)
    ref.backward()
    assert torch.allclose(loss.detach(), ref.detach()) and torch.allclose(x.grad, x2.grad)
