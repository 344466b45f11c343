"""Flat element-range shards (ZeRO/FSDP): written at N ranks, read at M, checksums, fallback.

The round trips run many writes and reads per process (elem_worker's batch mode): one
mpirun per world size and pass, a file written at N ranks read in a later launch at M.
The gapped file is written last in the 2-rank launch (the batch stops at its error, as its
own launch would); the corrupt file (a round trip's, a byte flipped) is read in a launch of
its own. Their error line on every rank is the point."""

import itertools
import json
import os
import random
import re
import shutil
import zlib

import h5py
import numpy as np
import pytest

from hpctrain.checkpoint.checksum import crc32_combine, merge_pieces, piece_crcs, verify_flat
from hpctrain.checkpoint.hyperslab import box_flat_boxes, box_runs, flat_boxes
from tests.mpirun import run_mpi, together

WORKER = ["-W", "ignore::RuntimeWarning", "-m", "tests.checkpoint.elem_worker"]


def _mpi(n, *args, env=None, check=True):
    return run_mpi(n, WORKER + [str(a) for a in args], env=env, check=check, timeout=120)


def _ok(proc, n):
    for r in range(n):
        assert f"rank {r}: OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("la,lb", [(0, 0), (1, 0), (0, 1), (3, 5), (1000, 1), (4 << 20, 12345),
                                   (17, (9 << 20) + 3)])
def test_crc32_combine_matches_zlib(la, lb):
    a, b = os.urandom(la), os.urandom(lb)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)


def test_flat_boxes_are_the_range_in_order():
    for shape in [(13, 7), (29,), (3, 5, 11), (2, 3, 4, 5)]:
        idx = np.arange(int(np.prod(shape))).reshape(shape)
        for start in range(0, idx.size + 1, 3):
            for stop in range(start, idx.size + 1, 2):
                boxes = flat_boxes(shape, start, stop)
                assert len(boxes) <= 2 * len(shape) - 1
                got = [x for off, cnt in boxes
                       for x in idx[tuple(slice(o, o + c) for o, c in zip(off, cnt))].ravel()]
                assert got == list(range(start, stop)), (shape, start, stop)


def test_box_runs_and_boxes_are_the_box_elements_in_order():
    rng = np.random.default_rng(1)
    for shape in [(13, 7), (29,), (3, 5, 11), (2, 3, 4, 5)]:
        idx = np.arange(int(np.prod(shape))).reshape(shape)
        for _ in range(40):
            off = tuple(int(rng.integers(0, s + 1)) for s in shape)
            cnt = tuple(int(rng.integers(0, s - o + 1)) for s, o in zip(shape, off))
            want = idx[tuple(slice(o, o + c) for o, c in zip(off, cnt))].ravel()
            lo = int(rng.integers(0, want.size + 1))
            hi = int(rng.integers(lo, want.size + 1))
            runs = box_runs(shape, off, cnt, lo, hi)
            got = [x for a, b in runs.tolist() for x in range(a, b)]
            assert got == list(want[lo:hi]), (shape, off, cnt, lo, hi)
            assert all(b > a for a, b in runs.tolist())
            boxes = box_flat_boxes(off, cnt, lo, hi)
            got = [x for o, c in boxes
                   for x in idx[tuple(slice(a, a + n) for a, n in zip(o, c))].ravel()]
            assert got == list(want[lo:hi])
    # a column slice of a matrix: one run per row; a row slice: one run
    assert box_runs((4, 6), (0, 2), (4, 3)).tolist() == [[2, 5], [8, 11], [14, 17], [20, 23]]
    assert box_runs((4, 6), (1, 0), (2, 6)).tolist() == [[6, 18]]


def test_pieces_cut_anywhere_merge_to_whole_block_crcs():
    rng = random.Random(0)
    data = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    belems = 64
    whole = [zlib.crc32(data[b:b + belems].tobytes()) for b in range(0, data.size, belems)]
    for _ in range(20):
        cuts = sorted({0, data.size, *rng.sample(range(1, data.size), 7)})
        pieces = [p for lo, hi in zip(cuts, cuts[1:]) for p in piece_crcs(data[lo:hi], lo, belems)]
        rng.shuffle(pieces)  # ranks gather in any order
        merged = merge_pieces(pieces, data.size, belems, 4, "x")
        assert list(merged) == whole
        assert verify_flat(data, 0, belems, merged, data.size) == []
    bad = data.copy()
    bad[130] += 1
    assert verify_flat(bad, 0, belems, merged, data.size) == [2]
    with pytest.raises(ValueError, match="x: .*cover the global tensor exactly once"):
        merge_pieces(piece_crcs(data[:500], 0, belems) + piece_crcs(data[501:], 501, belems),
                     data.size, belems, 4, "x")


# (write world, read world, checksum block bytes; 0: the default 4 MiB, one block per tensor)
CASES = [(4, 2, 64), (2, 4, 64), (3, 2, 64), (1, 4, 64), (3, 4, 0)]
SERIAL = [(4, 3), (3, 1)]
FORCE_SERIAL = {"HPCTRAIN_CKPT_FORCE_SERIAL": "1"}


def _round_trips():
    """(name, write world, read world, block bytes, write env) of every round trip."""
    return ([(f"rt-{n}-{m}-{b}", n, m, b, {}) for n, m, b in CASES]
            + [(f"serial-{n}-{m}", n, m, 64, FORCE_SERIAL) for n, m in SERIAL])


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    """Write every file, check its layout, read it back: {name: (path, write ok, read ok)},
    and "gap": (path, the 2-rank launch that wrote it last and failed).

    Launches go by world size, writes first; a read waits for its file's write. The one
    process runs beside the 2-rank launch (alone it leaves a core of two idle); neither reads
    what the other writes."""
    tmp = tmp_path_factory.mktemp("elem")
    trips = _round_trips()
    ops = []  # (world, name, [mode, path, block, env, gap])
    for name, n, m, block, env in trips:
        path = str(tmp / name / "ck.h5")
        os.makedirs(os.path.dirname(path))
        ops.append((n, f"{name}-write", ["write", path, block, env]))
        ops.append((m, f"{name}-read", ["read", path, 0, {}]))
    gap = tmp / "gap" / "ck.h5"  # the last op: its launch stops there
    gap.parent.mkdir()
    ops.append((2, "gap-write", ["write", str(gap), 0, {}, True]))
    done, results, launches, gapped = set(), {}, itertools.count(1), []

    def launch(world, batch):
        ops_path = tmp / f"ops-{next(launches)}.json"
        ops_path.write_text(json.dumps([op[2] for op in batch]))
        fails = batch[-1][1] == "gap-write"
        proc = _mpi(world, "batch", ops_path, check=not fails)
        if fails:
            gapped.append(proc)
        oks = set(re.findall(r"rank (\d+): OK (\d+)", proc.stdout))
        _ok(proc, world)
        return {name: all((str(r), str(i)) in oks for r in range(world))
                for i, (_, name, _) in enumerate(batch)}

    while len(done) < len(ops):
        for worlds in ((4,), (3,), (2, 1)):
            batches = [(world, [op for op in ops if op[0] == world and op[1] not in done
                                and (op[1].endswith("-write")
                                     or op[1].replace("-read", "-write") in done)])
                       for world in worlds]
            calls = [lambda w=w, b=b: launch(w, b) for w, b in batches if b]
            for got in together(*calls) if calls else ():
                results.update(got)
                done.update(got)
    return {"gap": (gap, *gapped),
            **{name: (tmp / name / "ck.h5", results[f"{name}-write"], results[f"{name}-read"])
               for name, *_ in trips}}


@pytest.mark.mpi
@pytest.mark.parametrize("n,m,block", CASES, ids=lambda c: str(c))
def test_written_at_n_read_at_m(round_trips, n, m, block):
    path, wrote, read = round_trips[f"rt-{n}-{m}-{block}"]
    assert wrote
    with h5py.File(path) as f:
        assert f["flat/t3x5x11"].shape == (3, 5, 11) and f["flat/scalar"].shape == ()
        assert f["box/cols"].shape == (12, 10) and f["box/tpdp"].shape == (4, 6, 5)
    assert read


@pytest.mark.mpi
@pytest.mark.parametrize("n,m", SERIAL)
def test_serial_fallback_elems(round_trips, n, m):
    path, wrote, read = round_trips[f"serial-{n}-{m}"]
    assert wrote
    with h5py.File(path) as f:
        assert f.attrs["layout"] == "virtual" and f["flat/m13x7"].is_virtual
    assert read


@pytest.mark.mpi
def test_flipped_byte_named_on_every_rank(round_trips, tmp_path):
    # A copy of the round trip's file written at 2 ranks in 64-byte blocks (no launch of its own).
    src, wrote, _ = round_trips["rt-2-4-64"]
    assert wrote
    path = tmp_path / "ck.h5"
    shutil.copyfile(src, path)
    with h5py.File(path) as f:
        offset = f["flat/t3x5x11"].id.get_offset()
    with open(path, "r+b") as fh:  # one byte of the raw data, behind HDF5's back
        fh.seek(offset + 101)
        byte = fh.read(1)
        fh.seek(offset + 101)
        fh.write(bytes([byte[0] ^ 0x10]))
    proc = _mpi(3, "read", path, check=False)
    assert proc.returncode != 0
    for r in range(3):
        assert f"rank {r}: checkpoint" in proc.stdout, proc.stdout + proc.stderr
    assert "'flat/t3x5x11' fails its checksum" in proc.stdout


@pytest.mark.mpi
def test_ranges_not_covering_rejected_on_every_rank(round_trips):
    path, proc = round_trips["gap"]  # written last in a 2-rank launch, which it ended
    assert proc.returncode != 0
    for r in range(2):
        assert f"rank {r}: flat/m13x7:" in proc.stdout, proc.stdout + proc.stderr
    assert not path.exists()
