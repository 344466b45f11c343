"""One watchdog case of the GPU check in its own process (a stall ends it by abort).

``python -m hpctrain.bench.gpu.watchdog_worker CASE --device cuda|cpu --timeout S --out DIR``

CASE ``stall``: an op queued behind a device kernel longer than the timeout; the watchdog
must report it (the process then ends by the watchdog's abort, exit code 1). CASE ``behind``:
ops each queued behind a kernel shorter than the timeout, the host one op ahead of the
device, for several timeouts; nothing may be reported (exit 0, one JSON line of figures).

One process is world size 1, where communicators record nothing (recording.py: size-1 groups
cannot stall); the op is therefore recorded as the communicator wrapper records an NCCL
op: ``RECORDER.start`` before it, ``RECORDER.end_on_device(entry, marker)`` after it, the
marker a CUDA event behind it on the current stream (runtime/comm/markers.py, as torchdist uses it). On cuda the
op is a real NCCL all-reduce (a one-rank group) when NCCL starts, queued behind
``torch.cuda._sleep``. On cpu no kernel exists to queue behind: the marker is a stand-in
whose ``query()`` turns True at the time the "kernel" would end (the recorder's marker
protocol), so the same recorder and watchdog code runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GROUP = "world.nccl"


class TimedMarker:
    """The recorder's marker protocol without a device: complete once ``at`` (monotonic)."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


class _Cuda:
    """The op and its marker on the GPU: a sleep kernel, then the op on the same stream."""

    def __init__(self):
        import torch

        self.torch = torch
        torch.cuda.init()
        self.tensor = torch.ones(1 << 20, device="cuda")
        self.op_kind = self._start_nccl()
        from hpctrain.runtime.comm.markers import stream_marker

        self.marker, self.marker_kind = stream_marker, "comm.markers.stream_marker (NCCL's marker)"
        self.cycles_per_s = self._calibrate()

    def _start_nccl(self) -> str:
        import torch.distributed as dist

        try:
            if not dist.is_initialized():
                dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                        device_id=self.torch.device("cuda", 0))
            dist.all_reduce(self.tensor)  # NCCL's communicator is made at the first op
            self.torch.cuda.synchronize()
            self.dist = dist
            return "NCCL all_reduce (one-rank group)"
        except Exception as e:  # noqa: BLE001 - the check still runs, on a plain kernel
            self.dist = None
            return f"a CUDA add (NCCL did not start: {type(e).__name__}: {e})"

    def _calibrate(self) -> float:
        torch = self.torch
        n = 20_000_000
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        return n / (start.elapsed_time(end) / 1000.0)

    def issue(self, rec, kernel_s: float):
        """Queue a kernel of ``kernel_s`` seconds, then the op behind it; record it."""
        cycles = int(kernel_s * self.cycles_per_s)
        while cycles > 0:  # kernels of at most ~0.5 s, back to back on the stream
            self.torch.cuda._sleep(min(cycles, 1_000_000_000))
            cycles -= 1_000_000_000
        e = rec.start(f"{GROUP}[0]", "allreduce", self.tensor.nbytes, self.tensor.dtype)
        if self.dist is not None:
            self.dist.all_reduce(self.tensor)
        else:
            self.tensor.add_(1)
        marker = self.marker()
        rec.end_on_device(e, marker)
        return marker

    def finish(self) -> None:
        self.torch.cuda.synchronize()
        if self.dist is not None:
            self.dist.destroy_process_group()


class _Cpu:
    op_kind = "no op (cpu: a stand-in marker, query() True once the kernel would end)"
    marker_kind = "TimedMarker"
    cycles_per_s = None

    def __init__(self):
        self.stream_end = 0.0  # when the stand-in stream would have run what was queued

    def issue(self, rec, kernel_s: float):
        import torch

        e = rec.start(f"{GROUP}[0]", "allreduce", 4 << 20, torch.float32)
        self.stream_end = max(time.monotonic(), self.stream_end) + kernel_s  # in order
        marker = TimedMarker(self.stream_end)
        rec.end_on_device(e, marker)
        return marker

    def finish(self) -> None:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=("stall", "behind"))
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=0.0, help="behind: how long to run")
    a = p.parse_args(argv)

    from hpctrain.runtime.flight import RECORDER
    from hpctrain.runtime.watchdog import Watchdog

    dev = _Cuda() if a.device == "cuda" else _Cpu()
    os.makedirs(a.out, exist_ok=True)
    channel = os.path.join(a.out, "channel")
    os.makedirs(channel, exist_ok=True)
    dog = Watchdog(a.timeout, channel, a.out, rank=0, size=1, recorder=RECORDER, owner=True)
    dog.attach_mirror()
    dog.start()
    info = {"op": dev.op_kind, "marker": dev.marker_kind, "cycles_per_s": dev.cycles_per_s,
            "poll_s": dog.poll, "grace_s": dog.grace}
    print("INFO " + json.dumps(info), flush=True)
    if a.case == "stall":
        # longer than the report takes (timeout + a poll + the grace) by a margin: if no
        # report comes, the op completes and the process says so
        kernel_s = a.timeout + dog.poll + dog.grace + 3.0
        print(f"ISSUED {time.time():.3f}", flush=True)
        marker = dev.issue(RECORDER, kernel_s)
        marker.synchronize()
        time.sleep(1.0 + dog.poll)  # the watchdog's last look
        dog.stop()
        dev.finish()
        print("NOSTALL " + json.dumps({"kernel_s": kernel_s}), flush=True)
        return 0
    # behind: each op behind a kernel of a quarter of the timeout; the host waits only for
    # the op before the previous one (one op ahead of the device, as a training loop whose
    # next step waits on the last one's loss): the queue holds half a timeout of kernels
    kernel_s = a.timeout / 4
    end = time.monotonic() + a.seconds
    prev, n = None, 0
    while time.monotonic() < end:
        marker = dev.issue(RECORDER, kernel_s)
        n += 1
        if prev is not None:
            prev.synchronize()
        prev = marker
    prev.synchronize()
    time.sleep(2 * dog.poll)
    RECORDER.reap_device()
    ends = [e[9] - e[8] for e in RECORDER.ring if e[9] is not None]
    dog.stop()
    dev.finish()
    stalled = os.path.exists(os.path.join(a.out, "stall-report.txt"))
    print("DONE " + json.dumps({"ops": n, "ended": len(ends), "kernel_s": kernel_s,
                                "max_pending_s": max(ends) if ends else None,
                                "still_pending": len(RECORDER.pending), "stall": stalled}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
