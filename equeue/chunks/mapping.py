"""A chunk's mappings and its disk blocks: the read map (in the manager's LRU), the
writable map with its prefaulted window ahead of the writer and its release behind
it, and the allocation of blocks ahead of the writer (reserve). Apart from the
appends and the reads, which use these, so that the window's rules read in one place."""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import TYPE_CHECKING, cast

from equeue.chunks.chunkstate import _MIN_STEP, _PAGE, ChunkState, _round_page, _ticks
from equeue.chunks.fileops import write_error
from equeue.chunks.identity import check_identity
from equeue.chunks.missing import removal_explains
from equeue.chunks.prefault import PREFAULTER
from equeue.chunks.runninghash import RunningHash
from equeue.chunks.space import allocate as _allocate  # (patched by tests, by that name)
from equeue.errors import (
    ChunkRemovedError,
    MissingChunkError,
    StoreWriteError,
    TruncatedError,
    location,
)
from equeue.format.chunk import HEADER_SIZE
from equeue.safepath import open_fd, open_file

if TYPE_CHECKING:
    from equeue.chunks.chunk import Chunk


class ChunkMapping(ChunkState):
    def mapping(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            try:
                f = open_file(self.path, "rb")  # closed below, after mapping
            except FileNotFoundError:
                if self.kept or (
                    self.in_view
                    and not removal_explains(self.path, self.start_number, self.version)
                ):
                    raise MissingChunkError(
                        "the chunk file is missing: the store did not remove it (deleted "
                        "while the store was open?)",
                        file=self.path,
                    ) from None
                raise ChunkRemovedError(
                    f"chunk {self.path} was removed (by retention or compaction) while in use"
                ) from None
            with f:
                # Cut short since it was opened (by hand: the store never shrinks a file
                # it keeps): said here, naming it, instead of a ValueError from mmap (an
                # empty file) or from the readers (data outside the mapping). The ongoing
                # chunk's file may be short (a read-only view does not extend it): only
                # the data scanned must be there.
                size = os.fstat(f.fileno()).st_size
                want = self.file_size if self.footer is not None else HEADER_SIZE + self.data_end
                if size < want:
                    # (The ongoing chunk's want is the data scanned: a minimum.)
                    least = "" if self.footer is not None else "at least "
                    raise TruncatedError(
                        f"chunk file is {size} bytes, expected {least}{want} (cut short while "
                        "the store was open)",
                        file=self.path,
                        offset=size,
                    )
                # Opened by name: it may be another file made under it since (a topic
                # deleted and made again), whose entries must not pass for this one's.
                check_identity(f.fileno(), self.path, self.header)
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._mm = mm
            self.last_used = next(_ticks)
            self._on_map(cast("Chunk", self))  # (only Chunk is ever instantiated)
        return mm

    def open_for_write(self) -> None:
        fd = open_fd(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE)
            # No read-around past the end: each fault there would read up to read_ahead_kb
            # of the unwritten tail into the page cache as zero pages, which SEEK_DATA then
            # reports as data, and the next recovery's nonzero_extent reads them all
            # (measured: 16 MiB past the end after a kill, 8 ms of a 38 ms reopen).
            unwritten = (HEADER_SIZE + self.data_end) // _PAGE * _PAGE
            with contextlib.suppress(OSError):
                self._mm.madvise(mmap.MADV_RANDOM, unwritten, len(self._mm) - unwritten)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._writable = True
        # What lies past the data is not known to be allocated: the first write allocates
        # from there (fallocate leaves blocks already allocated as they are).
        self.writable_end = self.data_end
        if PREFAULTER.enabled:
            self._address = PREFAULTER.address_of(self._mm)
        # The first window is asked for by the first append, not here: a store opened
        # only to read (or to recover and close) then maps none of it.
        self._prefault_mark = self.data_end - 1
        # A new chunk is hashed as it fills; one resumed after a reopen, all at complete().
        self._hashed = RunningHash() if self.data_end == 0 else None

    def mark_used(self) -> None:
        """Recency for the LRU of read mappings (ChunkManager closes the least recent)."""
        self.last_used = next(_ticks)

    def writable_mapping(self) -> mmap.mmap:
        """The mapping of a chunk open for writing, for writers that fill it in place."""
        mm = self._mm
        assert mm is not None and self._writable, "the chunk is not open for writing"
        return mm

    def _prefault(self, offset: int) -> None:
        """The writer passed ``offset`` (called once per half window, also by the C
        Sender): ask for the window after it to be faulted in, and release what lies a
        window behind it."""
        if self._hashed is not None and self._mm is not None:  # fresh, not all at complete()
            self._hashed.follow(self._mm, HEADER_SIZE + offset)
        start = ((HEADER_SIZE + offset) // _PAGE) * _PAGE
        stop = min(start + self._window, HEADER_SIZE + self.data_size)
        if stop > HEADER_SIZE + self.writable_end and self._alloc_step:
            # The window's blocks now, so it is allocated before it is faulted in (and a
            # step beyond, if steps are larger than windows). A full disk is left to the
            # write that needs the space: that one raises, before it writes anything (this
            # record is already published).
            with contextlib.suppress(StoreWriteError):
                self.reserve(stop - HEADER_SIZE, ahead=self._window < self._alloc_step)
        if PREFAULTER.enabled:
            # Never past the allocated blocks: faulting in a hole allocates it, and a full
            # disk there would go unnoticed until writeback.
            stop = min(stop, HEADER_SIZE + self.writable_end)
            PREFAULTER.request(self._address, self._address + start, stop - start)
        self._prefault_mark = offset + self._window // 2
        self.release_behind(offset - self._window // 2, offset)
        if self.on_advance is not None:
            self.on_advance(cast("Chunk", self))

    def release_behind(self, start: int, end: int) -> None:
        """A reader or the writer went from data offset ``start`` to ``end``: once per
        half window crossed, release what lies a window behind ``end`` (``_release``)."""
        step = self._window // 2
        if end // step != start // step:
            self._release(end)

    def _release(self, end: int) -> None:
        """The mapped pages more than a window behind data offset ``end`` leave this
        process's resident set. They stay in the page cache (dirty ones stay dirty, and
        are written back as before), and reading them again costs a minor fault, so the
        process's RSS is bounded by the windows in use, not by what it wrote, read or has
        not flushed yet (under "async" a writer outruns the disk by hundreds of MiB).
        Nothing relies on unflushed pages staying mapped: after a failed fdatasync no
        flush of the chunk is attempted again (``_fdatasync``)."""
        mm = self._mm
        stop = (HEADER_SIZE + end - self._window) // _PAGE * _PAGE
        if mm is not None and stop > 0:
            # From the start, so what a lagging reader faulted in goes too: zapping a
            # range already released costs about 1 µs, even 256 MiB of it (measured).
            with contextlib.suppress(ValueError, OSError):  # closed by another thread
                mm.madvise(mmap.MADV_DONTNEED, 0, stop)

    def release_mapping(self) -> None:
        """Drop the mapping; readers still holding it keep it alive until they finish."""
        self._end_writing()  # first: dropping the last reference unmaps at once
        self._mm = None
        self._close_fd()

    def _end_writing(self) -> None:
        if self._writable and self._address:
            PREFAULTER.forget(self._address)  # before the mapping can close
        self._writable = False
        self._prefault_mark = 1 << 62

    def _close_fd(self) -> None:
        with self._flush_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @property
    def is_mapped(self) -> bool:
        return self._mm is not None

    def reserve(self, end: int, *, ahead: bool = True) -> None:
        """Allocate the file's blocks up to data offset ``end`` (at most ``data_size``)
        and, if ``ahead``, a step beyond, before the writer writes there; under the write
        lock. A full disk raises DiskFullError with nothing written: a write into the
        mapping that meets it would be a SIGBUS."""
        start = HEADER_SIZE + self.writable_end
        want = HEADER_SIZE + end
        step = min(self._alloc_step, max(want, _MIN_STEP)) or self.data_size
        if not ahead:
            step = 0
        stop = min(_round_page(want + step), HEADER_SIZE + self.data_size)
        if stop <= start:
            return
        try:
            if not _allocate(self._fd, start, stop - start):
                stop = HEADER_SIZE + self.data_size  # no fallocate here: sparse, as before
        except OSError as exc:
            raise write_error(
                exc,
                f"allocating {stop - start} bytes of disk (ChunkManagerConfig.alloc_step="
                f"{self._alloc_step}) {location(None, start)}",
                self.path,
            ) from exc
        self.writable_end = stop - HEADER_SIZE
