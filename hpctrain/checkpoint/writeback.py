"""Start the kernel's write-back of a file range early, so the final fsync has little left to do."""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["Writeback", "libc_function"]

_SYNC_FILE_RANGE_WRITE = 2  # start write-out of dirty pages in the range; do not wait


def libc_function(name: str, argtypes: list):
    """libc's ``name`` with its argument types set, or None where this libc lacks it."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_SFR = (libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_uint])
        if sys.platform.startswith("linux") else None)


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
