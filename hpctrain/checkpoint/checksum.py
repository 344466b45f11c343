"""Per-block CRC32 checksums that ranks compute on their own rows and any reader verifies."""

from __future__ import annotations

import zlib

import numpy as np

from hpctrain.checkpoint.layout import num_rows

__all__ = ["block_crcs", "verify_blocks", "expected_blocks"]


def block_crcs(arr: np.ndarray, start_row: int, brows: int) -> dict[int, int]:
    """{block index: crc32} of the canonical blocks lying whole in arr (global rows from start_row).

    The writer makes owned row ranges start on block boundaries, so every block is computed
    by exactly one rank from memory, with no read-back.
    """
    out = {}
    if arr.ndim == 0:
        return {0: zlib.crc32(arr.tobytes())}
    n = arr.shape[0]
    first = -(-start_row // brows)
    for blk in range(first, (start_row + n + brows - 1) // brows + 1):
        lo, hi = blk * brows - start_row, (blk + 1) * brows - start_row
        if lo < 0 or lo >= n:
            continue
        out[blk] = zlib.crc32(memoryview(np.ascontiguousarray(arr[lo:hi])).cast("B"))
    return out


def verify_blocks(arr: np.ndarray, start_row: int, brows: int, crcs: np.ndarray,
                  total_rows: int) -> list[int]:
    """Block indices whose CRC differs; only blocks read whole (or ending the dataset) count."""
    bad = []
    if arr.ndim == 0:
        return [] if zlib.crc32(arr.tobytes()) == int(crcs[0]) else [0]
    n = arr.shape[0]
    for blk, crc in block_crcs(arr, start_row, brows).items():
        whole = (blk + 1) * brows <= start_row + n or start_row + n == total_rows
        if whole and blk * brows >= start_row and (blk >= len(crcs) or crc != int(crcs[blk])):
            bad.append(blk)
    return bad


def expected_blocks(shape: tuple, brows: int) -> int:
    """Number of checksum blocks of a dataset."""
    return -(-num_rows(shape) // brows)
