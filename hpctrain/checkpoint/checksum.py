"""CRC32 checksums of canonical blocks of the flattened tensor, from pieces on any ranks."""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["crc32_combine", "piece_crcs", "merge_pieces", "verify_flat", "expected_blocks"]

# Operators "append 2**k zero bytes" as GF(2) 32x32 matrices (column n = image of bit n), as in
# zlib's crc32_combine; built once, on first use.
_ZEROS: list[np.ndarray] = []
_BITS = np.arange(32, dtype=np.uint32)


def _square(mat: np.ndarray) -> np.ndarray:
    """mat @ mat over GF(2)."""
    bits = ((mat[:, None] >> _BITS[None, :]) & 1).astype(bool)  # bits[n, i]: bit i of column n
    return np.bitwise_xor.reduce(np.where(bits, mat[None, :], np.uint32(0)), axis=1)


def _times(mat: np.ndarray, vec: int) -> int:
    """mat @ vec over GF(2)."""
    out = 0
    for i in range(32):
        if vec >> i & 1:
            out ^= int(mat[i])
    return out


def _zeros_op(k: int) -> np.ndarray:
    if not _ZEROS:
        odd = np.array([0xEDB88320] + [1 << (n - 1) for n in range(1, 32)], dtype=np.uint32)
        _ZEROS.append(_square(_square(_square(odd))))  # 1 zero bit -> 2 -> 4 -> 8 (one byte)
    while len(_ZEROS) <= k:
        _ZEROS.append(_square(_ZEROS[-1]))
    return _ZEROS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(a + b) from crc1 = crc32(a), crc2 = crc32(b) and len2 = len(b) in bytes."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros_op(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def piece_crcs(flat: np.ndarray, start: int, belems: int) -> list[tuple[int, int, int, int]]:
    """(block, offset, length, crc32) of each piece of a canonical block in flat.

    flat holds global flat elements [start, start + len(flat)); offset and length are in
    elements within the block; a piece is a whole block unless the range cuts it.
    """
    flat = np.ascontiguousarray(flat).reshape(-1)
    stop = start + flat.size
    out = []
    buf = memoryview(flat.view(np.uint8) if flat.size else b"")
    size = flat.dtype.itemsize
    for blk in range(start // belems, -(-stop // belems)):
        lo, hi = max(start, blk * belems), min(stop, (blk + 1) * belems)
        crc = zlib.crc32(buf[(lo - start) * size:(hi - start) * size])
        out.append((blk, lo - blk * belems, hi - lo, crc))
    return out


def merge_pieces(pieces, total: int, belems: int, itemsize: int, name: str) -> np.ndarray:
    """One CRC per canonical block from all ranks' pieces, combined in element order."""
    by_block: dict[int, list] = {}
    for blk, off, n, crc in pieces:
        by_block.setdefault(blk, []).append((off, n, crc))
    out = np.zeros(expected_blocks(total, belems), dtype=np.uint32)
    for blk in range(len(out)):
        want = min(belems, total - blk * belems)
        crc, at = 0, 0
        for off, n, c in sorted(by_block.get(blk, [])):
            if off != at:
                break
            crc, at = (crc32_combine(crc, c, n * itemsize) if at else c), at + n
        if at != want:
            raise ValueError(
                f"{name}: the ranks' owned ranges leave elements [{blk * belems + at}, ...) of "
                f"the {total} unwritten or written twice; owned rows/elems must cover the "
                f"global tensor exactly once")
        out[blk] = crc
    return out


def verify_flat(flat: np.ndarray, start: int, belems: int, crcs: np.ndarray,
                total: int) -> list[int]:
    """Block indices whose CRC differs; flat must start and end on blocks (or the dataset end)."""
    bad = []
    for blk, off, n, crc in piece_crcs(flat, start, belems):
        whole = off == 0 and n == min(belems, total - blk * belems)
        if whole and (blk >= len(crcs) or crc != int(crcs[blk])):
            bad.append(blk)
    return bad


def expected_blocks(total: int, belems: int) -> int:
    """Number of checksum blocks of a dataset of total elements."""
    return -(-total // belems)
