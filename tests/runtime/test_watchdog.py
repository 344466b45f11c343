"""Fault suite of the stall watchdog (issue #19) under real mpirun, and the trace reader.

Each fault runs for ddp, zero3, fsdp and pipeline at 2 ranks, and for one 4-rank layout (a
pp=2 x dp=2 pipeline under zero3, or fsdp/ddp/zero3 over 4 replicas); the jobs of one fault
are launched together (they mostly wait out a timeout), so the file stays near two minutes.
Time bounds are measured from the fault (the fixture writes its time), not from the launch,
so the start-up of torch on a shared 2-core machine does not count against them.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpctrain.checkpoint.writer import FAULT_ENV
from hpctrain.runtime.flight import FlightRecorder
from hpctrain.runtime.flight_trace import divergences, format_divergences
from tests.mpirun import ROOT, mpi_env

STRATEGIES = ("ddp", "zero3", "fsdp", "pipeline")
TIMEOUT_S = 4.0
# 4-rank jobs: name -> (strategy, extra flags)
AT4 = {"pp2xdp2-zero3@4": ("pipeline", ["--mesh", "pp=2,dp=2", "--dp-flavour", "zero3"]),
       "fsdp@4": ("fsdp", []), "ddp@4": ("ddp", []), "zero3@4": ("zero3", [])}


def _launch(tmp_path, strategy, kind, call=5, extra_env=None, timeout_s=TIMEOUT_S, ranks=2,
            rank=1, name=None, flags=()):
    d = tmp_path / f"{name or strategy}-{kind}"
    d.mkdir()
    env = mpi_env({"STALL_DIR": str(d), "STALL_KIND": kind, "STALL_RANK": str(rank),
                   "STALL_CALL": str(call), **(extra_env or {})})
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
           "-m", "hpctrain", "train", "--strategy", strategy, *flags, "--steps", "40",
           "--model", "tests.fixtures.stall:factory", "--progress", "off",
           "--out-dir", str(d), "--collective-timeout-s", str(timeout_s)]
    out, err = open(d / "stdout", "w"), open(d / "stderr", "w")
    return d, subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err)


def _finish(jobs, limit_s=150):
    """Wait for every job; return {strategy: (dir, returncode, end time, stderr)}; never leave
    a stopped or running rank behind."""
    deadline, done = time.time() + limit_s, {}
    try:
        for name, (d, proc) in jobs.items():
            try:
                proc.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            done[name] = (d, proc.returncode, time.time() if name not in done else None,
                          (d / "stderr").read_text())
    finally:
        for d, proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
            for f in d.glob("pid-*"):
                pid = int(f.read_text())
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
    return done


def _end_times(jobs):
    """Poll all jobs together so each one's end time is its own."""
    ends = {}
    deadline = time.time() + 150
    while len(ends) < len(jobs) and time.time() < deadline:
        for name, (_, proc) in jobs.items():
            if name not in ends and proc.poll() is not None:
                ends[name] = time.time()
        time.sleep(0.1)
    return ends


def _fault_time(d):
    return float((d / "fault-time").read_text())


def _launch4(tmp_path, name, kind, rank=3, **kw):
    strategy, flags = AT4[name]
    return _launch(tmp_path, strategy, kind, ranks=4, rank=rank, name=name, flags=flags, **kw)


@pytest.mark.mpi
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    jobs = {s: _launch(tmp_path, s, "stop") for s in STRATEGIES}
    jobs["pp2xdp2-zero3@4"] = _launch4(tmp_path, "pp2xdp2-zero3@4", "stop")
    ends = _end_times(jobs)
    done = _finish(jobs)
    # rank 1 stops inside the first checkpoint save, after writing 2 datasets of its part of
    # the .tmp file (a hung file system): rank 0 waits in the save's next collective step.
    # Launched after the group: its time bound covers Open MPI's abort of a rank resumed
    # inside MPI-IO, which nine jobs on two cores stretched past it once.
    ckpt = tmp_path / "zero3-ckpt"
    last = {"zero3-ckpt": _launch(tmp_path, "zero3", "ckpt", rank=-1, flags=[
        "--checkpoint-dir", str(ckpt / "ck"), "--checkpoint-every", "2"],
        extra_env={FAULT_ENV: "1:2:stop"})}
    ends.update(_end_times(last))
    done.update(_finish(last))
    d, rc, _, err = done.pop("zero3-ckpt")
    assert rc != 0 and ends["zero3-ckpt"] - _fault_time(d) < TIMEOUT_S + 30, err
    assert err.count("hpctrain: STALL") == 1, err
    head = next(ln for ln in err.splitlines() if ln.startswith("hpctrain: STALL"))
    assert head.startswith("hpctrain: STALL step 2: checkpoint, ckpt_") and \
        head.endswith("on ranks [0]; ranks [1] never entered it"), err
    assert "rank 1 (pid" in err and "did not respond" in err, err
    assert "last recorded: step 2 checkpoint, ckpt_write #" in err, err  # its .tmp part
    assert (d / "stall-report.txt").read_text().splitlines()[0] == head
    assert [p.name for p in (d / "ck").iterdir()] == ["ckpt-000002.h5.tmp"]
    for d, *_ in [done[s] for s in done] + [(d,)]:  # the reporter removed the channel
        assert not list(d.glob(".hpctrain-watchdog-*")), list(d.iterdir())
    d, rc, _, err = done.pop("pp2xdp2-zero3@4")
    # rank 3 (last stage, second replica) stops: its stage peer and its replica wait on it
    assert rc != 0 and ends["pp2xdp2-zero3@4"] - _fault_time(d) < TIMEOUT_S + 30, err
    assert err.count("hpctrain: STALL") == 1, err
    assert ("ranks [3] never entered it" in err or "its peer ranks [3] never answered" in err), err
    assert "rank 3 (pid" in err and "did not respond" in err and "last recorded: step " in err, err
    assert sorted(p.name for p in d.glob("stall-rank-*.txt")) == [
        "stall-rank-0.txt", "stall-rank-1.txt", "stall-rank-2.txt"], err
    text, code = format_divergences(str(d))
    assert code == 0 and "no record from ranks [3]" in text, text
    for s, (d, rc, _, err) in done.items():
        assert rc != 0, (s, err)
        took = ends[s] - _fault_time(d)
        assert took < TIMEOUT_S + 30, (s, took, err)
        assert "hpctrain: STALL" in err and err.count("hpctrain: STALL") == 1, (s, err)
        assert ("ranks [1] never entered it" in err if s != "pipeline" else
                "its peer ranks [1] never answered" in err), (s, err)
        assert "last recorded: step " in err, (s, err)  # rank 1's last op, from its mirror
        assert "rank 1 (pid" in err and "did not respond" in err, (s, err)
        stack = (d / "stall-rank-0.txt").read_text()
        # the live rank's main thread is inside the pending op (our comm layer or Horovod's)
        assert "hpctrain/runtime/comm/" in stack or "synchronize" in stack, (s, stack)
        assert not (d / "stall-rank-1.txt").exists()
        record = json.loads((d / "flight-rank-0.json").read_text())
        assert record["rank"] == 0 and record["pending"], (s, record["pending"])
        text, code = format_divergences(str(d))
        assert code == 0 and "divergence in" in text and "no record from ranks [1]" in text, \
            (s, text)


@pytest.mark.mpi
def test_a_killed_rank_ends_the_job(tmp_path):
    jobs = {s: _launch(tmp_path, s, "kill") for s in STRATEGIES}
    jobs["fsdp@4"] = _launch4(tmp_path, "fsdp@4", "kill", rank=2)
    ends = _end_times(jobs)
    done = _finish(jobs)
    for s, (d, rc, _, err) in done.items():
        assert rc != 0, (s, err)
        assert ends[s] - _fault_time(d) < 30, (s, ends[s] - _fault_time(d), err)


@pytest.mark.mpi
def test_an_exception_names_the_rank_and_a_slow_rank_is_left_alone(tmp_path):
    jobs = {s: _launch(tmp_path, s, "raise") for s in STRATEGIES}
    jobs["ddp@4"] = _launch4(tmp_path, "ddp@4", "raise", rank=2)
    # Slower than the others by half the timeout, twice: must finish normally.
    jobs["slow"] = _launch(tmp_path, "zero3", "sleep", call=5, timeout_s=2 * TIMEOUT_S,
                           extra_env={"STALL_SLEEP_S": str(TIMEOUT_S)})
    ends = _end_times(jobs)
    done = _finish(jobs)
    d, rc, _, err = done.pop("slow")
    assert rc == 0 and "STALL" not in err, err
    assert not list(d.glob("stall-rank-*.txt"))
    for s, (d, rc, _, err) in done.items():
        assert rc != 0, (s, err)
        assert ends[s] - _fault_time(d) < 30, (s, err)
        rank = "2/4" if s.endswith("@4") else "1/2"
        assert f"[hpctrain rank {rank}" in err and "injected failure" in err, (s, err)
        # the failing rank removed the watchdog's channel before MPI_Abort (no atexit then)
        assert not list(d.glob(".hpctrain-watchdog-*")), (s, list(d.iterdir()))


@pytest.mark.mpi
def test_a_skipped_collective_is_named_by_its_sequence_number(tmp_path):
    """One rank's data says 'no metric this time': it skips the user's all-reduce; the ranks
    then wait in different ops and the report names the op and sequence number it skipped."""
    jobs = {s: _launch(tmp_path, s, "skip") for s in ("ddp", "zero3", "fsdp")}
    jobs["zero3@4"] = _launch4(tmp_path, "zero3@4", "skip", rank=2)
    ends = _end_times(jobs)
    done = _finish(jobs)
    for s, (d, rc, _, err) in done.items():
        skipper = 2 if s.endswith("@4") else 1
        assert rc != 0 and ends[s] - _fault_time(d) < TIMEOUT_S + 30, (s, err)
        assert err.count("hpctrain: STALL") == 1, (s, err)
        # every rank is alive: some wait in the metric all-reduce the skipper never entered,
        # the skipper went on to the strategy's next collective
        assert "did not respond" not in err, (s, err)
        assert "the ranks wait in different collectives" in err, (s, err)
        (row,) = [ln for ln in err.splitlines() if ln.startswith("    ") and "over metric[" in ln]
        assert row.strip().startswith("allreduce #") and row.endswith(f"ranks [{skipper}]"), \
            (s, row)
        assert f"rank {skipper}: pending step " in err, (s, err)
        text, code = format_divergences(str(d))
        seq = row.split("allreduce #")[1].split()[0]
        assert code == 0 and f"#{seq}" in text and f"[{skipper}]" in text, (s, text)


# ---- no MPI ---------------------------------------------------------------------------


def test_recorder_counts_per_group_and_tracks_pending():
    rec = FlightRecorder(capacity=3)
    a = rec.start("dp[0,1]", "allreduce", 8, "float32")
    rec.end(a)
    b = rec.start("dp[0,1]", "allgather", 16, "float32")
    c = rec.start("pp[0,1]", "isend", 4, "float32", peer=1)
    assert (a.seq, b.seq, c.seq) == (1, 2, 1)
    assert rec.oldest_pending() is b
    rec.end(b)
    rec.end(c)
    assert rec.oldest_pending() is None
    for _ in range(5):
        rec.end(rec.start("dp[0,1]", "barrier"))
    assert len(rec.ring) == 3 and rec.seqs["dp[0,1]"] == 7 and rec.seqs["pp[0,1]:p2p"] == 1


def test_mirror_file_holds_the_last_op(tmp_path):
    """What a stopped rank last did, read from its mirror by another process."""
    import mmap

    from hpctrain.runtime.abort import _context, set_context
    from hpctrain.runtime.flight import MIRROR_SIZE, NAME_SLOTS, read_mirror

    path = tmp_path / "last-0.bin"
    path.write_bytes(b"\0" * MIRROR_SIZE)
    assert read_mirror(str(path)) is None  # nothing recorded yet
    rec, saved = FlightRecorder(), dict(_context)
    with open(path, "r+b") as f:
        rec.set_mirror(mmap.mmap(f.fileno(), MIRROR_SIZE))
        try:
            set_context(step=7, phase="backward")
            rec.end(rec.start("dp[0,1]", "allreduce", 8, "float32"))
            e = rec.start("dp[0,1]", "reduce_scatter", 8, "float32")
            got = read_mirror(str(path))
            assert (got["op"], got["group"], got["seq"], got["step"], got["phase"],
                    got["end"]) == ("reduce_scatter", "dp[0,1]", 2, 7, "backward", None)
            rec.end(e)
            assert read_mirror(str(path))["end"] == e.end
            # more distinct (op, group, phase) than the table holds: the numbers stay right
            for i in range(NAME_SLOTS + 2):
                rec.end(rec.start(f"g{i}[0,1]", "barrier"))
            got = read_mirror(str(path))
            assert (got["op"], got["count"], got["seq"]) == ("?", rec.count, 1)
        finally:
            rec.set_mirror(None)
            _context.clear()
            _context.update(saved)


def test_divergence_names_the_first_op_not_entered_by_all():
    def entry(seq, op, end=1.0):
        return {"seq": seq, "op": op, "group": "dp[0,1,2]", "nbytes": 8, "dtype": "float32",
                "peer": None, "step": 3, "phase": "backward", "start": 0.0, "end": end}
    records = {
        0: {"size": 3, "seqs": {"dp[0,1,2]": 5}, "entries": [entry(4, "reduce_scatter"),
                                                         entry(5, "allreduce", None)],
            "pending": [entry(5, "allreduce", None)]},
        1: {"size": 3, "seqs": {"dp[0,1,2]": 5}, "entries": [entry(5, "allreduce", None)],
            "pending": [entry(5, "allreduce", None)]},
        2: {"size": 3, "seqs": {"dp[0,1,2]": 4}, "entries": [entry(4, "reduce_scatter")],
            "pending": []},
    }
    (d,) = divergences(records)
    assert (d["seq"], d["op"]["op"], d["entered"], d["missing"]) == (5, "allreduce", [0, 1], [2])
    assert d["last"][2]["op"] == "reduce_scatter"


def test_group_keys_stay_short_and_parse_back():
    from hpctrain.runtime.flight import _ranks_text, members_of

    for ranks, text in (([0, 1], "0,1"), ([0, 2], "0,2"), (list(range(4096)), "0-4095"),
                        ([1, 3, 5, 7], "1-7/2"), ([0, 5, 6], "0,5,6")):
        assert _ranks_text(ranks) == text and members_of(f"dp[{text}]", 8) == ranks
    assert members_of("world[size4]", 4) == [0, 1, 2, 3]


def test_channels_left_by_killed_jobs_are_swept(tmp_path):
    """A job killed by a signal runs no cleanup: the next start removes its channel (owner
    gone, or nothing changed for a day), never a running job's."""
    import socket

    from hpctrain.runtime.watchdog_channel import STALE_CHANNEL_S, stall_dir_of, sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    chans = {}
    for name, owner, age in (("dead", f"{host} {dead.pid}", 0),
                             ("alive", f"{host} {os.getpid()}", 0),
                             ("remote-fresh", "elsewhere 1", 0),
                             ("remote-old", "elsewhere 1", STALE_CHANNEL_S + 60),
                             ("no-owner-fresh", None, 0),
                             # made before the owner file: its heartbeats name the processes
                             ("hb-dead", {"host": host, "pid": dead.pid}, 0),
                             ("hb-alive", {"host": host, "pid": os.getpid()}, 0)):
        d = chans[name] = tmp_path / f".hpctrain-watchdog-{name}"
        d.mkdir()
        (d / "hb-0.json").write_text(json.dumps(owner if isinstance(owner, dict) else {}))
        if isinstance(owner, str):
            (d / "owner").write_text(owner + "\n")
        for f in [d, *d.iterdir()]:
            os.utime(f, (time.time() - age,) * 2)
    (tmp_path / "unrelated").mkdir()
    sweep_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".hpctrain-watchdog-alive", ".hpctrain-watchdog-hb-alive",
        ".hpctrain-watchdog-no-owner-fresh", ".hpctrain-watchdog-remote-fresh", "unrelated"]
    assert stall_dir_of("/tmp/.hpctrain-watchdog-ab12") == "/tmp/hpctrain-stall-ab12"
