"""wait_idle completes a request without holding a core (the pipeline's receive wait)."""

import time

from hpctrain.runtime.comm.idle import wait_idle


class _DoneAt:
    """A request that completes at a wall-clock time; counts its polls."""

    def __init__(self, delay):
        self.at, self.polls = time.perf_counter() + delay, 0

    def test(self):
        self.polls += 1
        return time.perf_counter() >= self.at


def test_wait_idle_returns_once_done_and_sleeps_meanwhile():
    done = _DoneAt(0.0)
    wait_idle(done)
    assert done.polls == 1  # already complete: one poll, no sleep
    cpu0, t0 = time.process_time(), time.perf_counter()
    req = _DoneAt(0.2)
    wait_idle(req)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert time.perf_counter() >= req.at and wall >= 0.2  # returned only once complete
    # A spinning wait would burn ~100% of a core (and poll millions of times); naps of at
    # most 50 us bound the polls by wall / 50 us and leave most of the core to others.
    assert req.polls <= wall / 50e-6 + 10, req.polls
    assert cpu < 0.5 * wall, (cpu, wall)
