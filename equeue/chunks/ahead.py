"""The next chunk file made ahead, off the writer's thread (RocketMQ's
AllocateMappedFileService), so that a roll-over only installs it.

Making a chunk costs a temporary file, its first blocks allocated, the header written,
an fsync, the rename and the directory's fsync: 1.3-3.2 ms median, up to 10 ms, on the
broker's loop while every client waited (docs/broker.md). Here one thread for the
process makes the file of the chunk after the ongoing one of each directory that asks
(``ChunkManagerConfig.make_ahead``: the message log), under a temporary name
(``ahead-{number}.{uuid}.tmp``: no ``chunk-`` prefix, which scripts glob), allocated,
its header written and fsynced. A roll-over checks that the entry under that name is
still the file this thread made (the same inode, the size, the header), renames it to
the chunk's name and maps it; the directory's fsync that makes the name durable is
queued here and awaited (or done) by the first fdatasync that vouches for data in the
chunk (``Chunk.make_name_durable``).

Until it is renamed the file is not data: its name ends in ``.tmp``, which readers,
the inspector and compaction skip, and which a writable open removes (naming it a file
made ahead) once that open has succeeded (a refused open leaves it) or at the
first roll-over. A manager's close deletes it. At most one file is made ahead per
directory, and none is asked for while one is ready or being made.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from equeue.chunks.chunkstate import _MIN_STEP, _round_page
from equeue.chunks.space import allocate as _allocate  # (patched by tests, by that name)
from equeue.format.chunk import (
    HEADER_SIZE,
    TEMP_SUFFIX,
    ChunkHeader,
    chunk_file_size,
)
from equeue.safepath import open_fd

log = logging.getLogger("equeue.chunks")

AHEAD_PREFIX = "ahead-"


def is_ahead_name(name: str) -> bool:
    return name.startswith(AHEAD_PREFIX) and name.endswith(TEMP_SUFFIX)


@dataclass(frozen=True)
class AheadFile:
    """A chunk file made ahead: where, what it holds, and the inode it was made as."""

    path: Path
    header: ChunkHeader
    allocated: int  # bytes from the file's start whose blocks are allocated
    device: int
    inode: int


def make_ahead_file(directory: Path, header: ChunkHeader, alloc_step: int) -> AheadFile:
    """The file of the chunk ``header`` describes, under a temporary name, durable (its
    header fsynced); its directory entry is not fsynced: the file is not data yet."""
    number = header.chunk_start_number
    path = directory / f"{AHEAD_PREFIX}{number:012d}.{uuid.uuid4().hex}{TEMP_SUFFIX}"
    size = chunk_file_size(header.chunk_data_size)
    first = size
    if alloc_step:
        first = min(_round_page(HEADER_SIZE + min(alloc_step, _MIN_STEP)), size)
    fd = open_fd(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        if not _allocate(fd, 0, first):
            first = size  # no fallocate here: a sparse file, as Chunk.create makes
            os.ftruncate(fd, size)
        elif first < size:
            os.ftruncate(fd, size)
        os.pwrite(fd, header.pack(), 0)
        os.fsync(fd)
        found = os.fstat(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return AheadFile(path, header, first, found.st_dev, found.st_ino)


def check_ahead_file(ahead: AheadFile) -> str | None:
    """None if the entry under ``ahead.path`` is still the file made ahead, intact;
    else what is wrong with it (another file, a link, a directory, the size, the header).
    Opened without following a link, so nothing is read or written through one."""
    try:
        found = os.lstat(ahead.path)
    except OSError as exc:
        return f"it is gone ({exc.strerror or exc})"
    if not stat.S_ISREG(found.st_mode):
        return f"it is no regular file (mode {found.st_mode:o})"
    if (found.st_dev, found.st_ino) != (ahead.device, ahead.inode):
        return "it is another file than the one made ahead"
    if found.st_size != chunk_file_size(ahead.header.chunk_data_size):
        return f"its size is {found.st_size}, not {chunk_file_size(ahead.header.chunk_data_size)}"
    try:
        fd = open_fd(ahead.path, os.O_RDONLY)
    except OSError as exc:
        return f"it cannot be opened ({exc})"
    try:
        if os.pread(fd, HEADER_SIZE, 0)[: len(ahead.header.pack())] != ahead.header.pack():
            return "its header is not the one written"
    finally:
        os.close(fd)
    return None


def discard(path: Path, why: str, level: int = logging.WARNING) -> None:
    """Remove a file made ahead that will not be installed. A link is removed, not
    followed; a directory planted under the name is left (the next open refuses it)."""
    log.log(level, "not installing the chunk file made ahead %s: %s", path, why)
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            path.unlink()


def remove_leftover(path: Path) -> None:
    """Remove a file made ahead that a stopped writer left (never data). A link is removed,
    not followed; what cannot be removed is said and left."""
    log.warning(
        "removing %s: a chunk file made ahead that was never installed "
        "(a writer stopped before the roll-over; it held no data)",
        path,
    )
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            path.unlink()
            return
        problem = "it is a directory"
    except FileNotFoundError:
        return
    except OSError as exc:
        problem = str(exc)
    log.warning("could not remove %s: %s; it is left", path, problem)


class ChunkMaker:
    """One daemon thread, started at the first request, running queued jobs in order."""

    def __init__(self) -> None:
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(self, job: Callable[[], None]) -> None:
        with self._wakeup:
            if self._thread is None or self._pid != os.getpid():  # (a fork has no thread)
                self._pid = os.getpid()
                self._jobs.clear()
                self._thread = threading.Thread(
                    target=self._run, name="equeue-chunk-maker", daemon=True
                )
                self._thread.start()
            self._jobs.append(job)
            self._wakeup.notify()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._jobs:
                    self._wakeup.wait()
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a job's failure is its own (it falls back); the thread stays
                log.exception("a chunk-maker job failed")


MAKER = ChunkMaker()
