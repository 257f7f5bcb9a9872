"""A chunk file's disk blocks: allocating them (``allocate``), and giving back those a
completed chunk does not use (``punch_hole``).

A chunk's blocks are allocated in steps ahead of its writer (Chunk.reserve), so when a
record does not fit and the chunk is completed, the blocks between its data and its
footer were allocated for nothing: up to a step, or the record that did not fit. They
are punched out (``fallocate(FALLOC_FL_PUNCH_HOLE)``; the file keeps its size, and the
hole reads as zeros, as it did), so what completed chunks hold on disk is their data.
Python's ``os`` has no ``fallocate`` with a mode, hence ctypes; where the call is
missing or refused, the blocks stay allocated (the disk holds a little more, nothing
else changes).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os

log = logging.getLogger("equeue.chunks")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _load_fallocate() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fallocate.restype = ctypes.c_int
    return fallocate


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the blocks of [offset, offset + length) of the file, keeping its size; False
    where that cannot be done (the blocks then stay allocated)."""
    if _fallocate is None or length <= 0:
        return False
    mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if _fallocate(fd, mode, offset, length) != 0:
        log.debug("punching a hole failed: errno %d", ctypes.get_errno())
        return False
    return True


def allocate(fd: int, offset: int, length: int) -> bool:
    """posix_fallocate; False where the file system cannot (the file stays sparse there)."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return False
    return True
