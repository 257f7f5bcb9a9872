"""The file-system steps every durable file of the store shares: fsyncing a directory
after an entry in it changed, and an OSError turned into the store's write error
(DiskFullError for a full disk). Apart from the chunk so that the chunk's own modules
(and atomicfile, the journals, the Spark sink) can use them without importing Chunk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from equeue.errors import DiskFullError, StoreReadError, StoreWriteError


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_error(exc: OSError, path: Path | str, read_only: bool) -> StoreWriteError | StoreReadError:
    """Opening a chunk directory's files failed: the store's error, naming the file (the
    directory if the OS did not say) and errno, and at EMFILE/ENFILE the limit to raise."""
    where = exc.filename if isinstance(exc.filename, str) else path
    text = f"opening the chunk files failed for {os.fspath(where)}: {exc.strerror or exc}"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        text += (
            " (the process's open-file limit: raise it with ulimit -n, or lower the broker's "
            "--max-connections or StoreConfig.max_open_files)"
        )
    if read_only:
        return StoreReadError(exc.errno or errno.EIO, text)
    cls = (
        DiskFullError if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else StoreWriteError
    )
    return cls(exc.errno or errno.EIO, text)


def write_error(exc: OSError, what: str, path: Path | str) -> StoreWriteError:
    cls = (
        DiskFullError if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else StoreWriteError
    )
    return cls(
        exc.errno or errno.EIO, f"{what} failed for {os.fspath(path)}: {exc.strerror or exc}"
    )
