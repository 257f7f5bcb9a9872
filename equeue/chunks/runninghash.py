"""A chunk's footer checksum (XXH3-64 of its header and data) taken as the writer goes.

Why: ``Chunk.complete`` hashed the whole chunk at once, 256 MiB for a log chunk of the
default size, after the pages had left the process (``Chunk._release``) and some the
page cache: measured on this machine, the send that completed a 256 MiB log chunk took
0.22 s and 44 ms of CPU beyond its flush, on the writer's thread (the broker's loop:
every connection waited). Now the writer hashes what it wrote each time it passes half a
window (``Chunk._prefault``, under the write lock, while the bytes are fresh), and
``complete`` hashes only the rest. The checksum is the same: a streaming hash of the
same bytes in the same order, of bytes the writer never changes again (the header is
written once, when the chunk is created; a record is final once ``data_end`` passes it).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import xxhash


class RunningHash:
    """The hash of a chunk file's first ``upto`` bytes."""

    __slots__ = ("_hasher", "_lock", "upto")

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()
        self.upto = 0
        self._lock = threading.Lock()  # (the writer's calls hold the write lock already)

    def follow(self, mm: mmap.mmap, stop: int) -> None:
        """Hash the file's bytes up to ``stop``, all final."""
        with self._lock:
            if stop > self.upto:
                with memoryview(mm) as view:
                    self._hasher.update(view[self.upto : stop])
                self.upto = stop

    def rest(self) -> tuple[xxhash.xxh3_64, int]:
        """A copy of the hasher and where it stopped, for ``complete`` to finish. A copy:
        a ``complete`` that fails after hashing (its footer's block meeting a full disk)
        is called again by the next write, and must hash the rest once, not twice."""
        with self._lock:
            return self._hasher.copy(), self.upto


def chunk_checksum(
    hashed: RunningHash | None, mm: mmap.mmap, end: int, step: int, release: Callable[[int], None]
) -> int:
    """The footer's checksum of the file's first ``end`` bytes: what ``hashed`` has not
    taken yet (all of them without it), a window (``step``) at a time, calling ``release``
    with the file offset a window behind, so completing a chunk does not fault all of it
    back in at once."""
    hasher, start = hashed.rest() if hashed is not None else (xxhash.xxh3_64(), 0)
    with memoryview(mm) as view:
        for at in range(start, end, step):
            hasher.update(view[at : min(end, at + step)])
            release(at + step)
    return hasher.intdigest()
