"""The file-system steps every durable file of the store shares: fsyncing a directory
after an entry in it changed, and an OSError turned into the store's write error
(DiskFullError for a full disk). Apart from the chunk so that the chunk's own modules
(and atomicfile, the journals, the Spark sink) can use them without importing Chunk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from equeue.errors import DiskFullError, StoreWriteError


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_error(exc: OSError, what: str, path: Path | str) -> StoreWriteError:
    cls = (
        DiskFullError if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else StoreWriteError
    )
    return cls(
        exc.errno or errno.EIO, f"{what} failed for {os.fspath(path)}: {exc.strerror or exc}"
    )
