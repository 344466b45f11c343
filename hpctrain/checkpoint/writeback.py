"""Start the kernel's write-back of a file range early, so the final fsync has little left to do."""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["Writeback"]

_SYNC_FILE_RANGE_WRITE = 2  # start write-out of dirty pages in the range; do not wait


def _libc_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SFR = _libc_sync_file_range()


class Writeback:
    """Kicks off asynchronous write-back of byte ranges of path (a no-op where unsupported).

    The page cache is per file, so this works on the ranges that MPI-IO wrote through its own
    handle; the device then flushes one tensor while the rank copies and checksums the next.
    """

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY) if _SFR is not None else -1

    def start(self, offset: int, nbytes: int) -> None:
        if self.fd >= 0 and nbytes > 0:
            _SFR(self.fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
