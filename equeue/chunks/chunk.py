"""One chunk file: creation, appends, completion, reads and the position map."""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Generator
from pathlib import Path

import xxhash

from equeue.chunks.footer import footer_timestamps
from equeue.chunks.missing import removal_explains
from equeue.chunks.prefault import PREFAULTER, WINDOW
from equeue.chunks.runninghash import RunningHash, chunk_checksum
from equeue.chunks.space import allocate as _allocate  # (patched by tests, by that name)
from equeue.chunks.space import punch_hole
from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    CorruptRecordError,
    DiskFullError,
    MissingChunkError,
    PositionNotFoundError,
    StoreWriteError,
    TruncatedError,
    location,
)
from equeue.format.chunk import (
    _FRAME_PACKERS,
    CHECKSUM_MASK,
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    FRAME_SUFFIX,
    HEADER_SIZE,
    MAP_ENTRY,
    MAP_ENTRY_SIZE,
    TEMP_SUFFIX,
    ChunkFooter,
    ChunkHeader,
    chunk_file_name,
    chunk_file_size,
    frame_packer,
    frame_problem,
    record_checksum,
)
from equeue.safepath import open_fd, open_file

_xxh3 = xxhash.xxh3_64_intdigest  # record_checksum() inlined on the hot paths
_unpack_prefix = FRAME_PREFIX.unpack_from
_unpack_suffix = FRAME_SUFFIX.unpack_from
_PAGE = mmap.PAGESIZE
Records = Generator[tuple[int, bytes], None, int]
# The window of chunks of fixed-size records. Not smaller: without the C accelerator
# each prefault request costs the writer two GIL hand-offs (prefault.py). Allocated in
# steps, their window is a step (32 KiB for a queue): a request per 2,730 entries.
_FIXED_WINDOW = 256 << 10
# A chunk's first allocation step (ChunkManagerConfig.alloc_step); each later one is as
# large as the chunk's data so far, up to alloc_step: few fallocate calls, little slack.
_MIN_STEP = 64 << 10
_ticks = itertools.count(1)  # recency for the LRU of read maps; next() is atomic in CPython


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


class Chunk:
    """A chunk file and what is known of it in memory.

    ``data_end`` is the committed end of the data area: readers never look past
    it, and the writer raises it only after a record's bytes are in place.
    """

    def __init__(
        self,
        path: Path,
        header: ChunkHeader,
        footer: ChunkFooter | None,
        *,
        version: int,
        data_end: int,
        record_count: int,
        max_record_size: int,
        on_map: Callable[[Chunk], None],
        alloc_step: int = 0,
    ) -> None:
        self.path = path
        self.header = header
        # Plain attributes for the hot paths (the header's are properties).
        self.base = header.start_position
        self.data_size = header.chunk_data_size
        self.footer = footer
        self.version = version
        self.data_end = data_end
        self.flushed_end = data_end
        # Up to where this chunk is known durable: an fdatasync of this process covered it,
        # or (the ongoing chunk at open) a checkpoint's tail hint said so. Not flushed_end,
        # which at open also covers what recovery found in the page cache.
        self.synced_end = data_end
        self.record_count = record_count
        # The data offset up to which the file's blocks are allocated, for the writer:
        # every write stays below it, and reserve() moves it before a write would not.
        self.writable_end = data_end
        self._alloc_step = alloc_step  # 0: the whole chunk at once
        self.last_used = 0
        self.scan_problem: str | None = None  # why recovery's scan stopped, if not at a clean end
        self._max_record_size = max_record_size
        self._on_map = on_map
        self._mm: mmap.mmap | None = None
        self._writable = False
        # The writable chunk keeps its file open to fdatasync it: unlike mmap.flush
        # (msync), os.fdatasync lets other threads run, which group commit relies on.
        self._fd = -1
        self._flush_lock = threading.Lock()  # one fdatasync at a time; close waits for it
        # After a failed fdatasync: the data offset from which nothing was known durable,
        # the OS's reason, and the error raised; no later flush can vouch for that data.
        self._failed: tuple[int, str, StoreWriteError] | None = None
        self._address = 0  # of the writable mapping, for the prefaulter
        self._prefault_mark = 1 << 62  # data offset past which to prefault the next window
        self._hashed: RunningHash | None = None  # the footer's checksum as the writer goes
        # The writer's manager keeps this file until it removes the chunk itself
        # (retention, a compaction's replacement): a file gone meanwhile is damage, not
        # a removal. A read-only view's chunk (in_view) is judged from the directory
        # (missing.py): the writer removes files under it, oldest first or replaced.
        self.kept = False
        self.in_view = False
        # Queue chunks hold 12-byte entries: a log-sized window would keep a MiB or two of
        # each resident for a few hundred KiB of entries a second.
        self._window = WINDOW if not header.record_size else _FIXED_WINDOW
        if header.record_size and alloc_step:
            # Faulted in no further than a step ahead: the queue's slack on disk stays a step.
            self._window = min(_FIXED_WINDOW, max(_round_page(alloc_step), 2 * _PAGE))
        # Called under the write lock each time the writer passes a half window (the
        # store's LiveTailWriter.advance, for the log's chunks).
        self.on_advance: Callable[[Chunk], None] | None = None
        # Called when an fdatasync of this chunk fails (the store's LiveTailWriter.invalidate).
        self.on_sync_failure: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "ongoing" if self.footer is None else "completed"
        return f"<Chunk {self.path.name} {state} data_end={self.data_end}>"

    # --- identity ------------------------------------------------------------

    @property
    def start_number(self) -> int:
        return self.header.chunk_start_number

    @property
    def end_number(self) -> int:
        return self.header.chunk_end_number

    @property
    def start_position(self) -> int:
        return self.header.start_position

    @property
    def end_position(self) -> int:
        return self.header.end_position

    @property
    def is_completed(self) -> bool:
        return self.footer is not None

    @property
    def file_size(self) -> int:
        if self.header.compacted and self.footer is not None:
            map_bytes = self.footer.map_entry_count * MAP_ENTRY_SIZE
            return HEADER_SIZE + self.footer.physical_data_size + map_bytes + FOOTER_SIZE
        return chunk_file_size(self.header.chunk_data_size)

    # --- creation ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        directory: Path,
        header: ChunkHeader,
        *,
        version: int,
        max_record_size: int,
        on_map: Callable[[Chunk], None],
        alloc_step: int = 0,
    ) -> Chunk:
        """Temp file, preallocate (the first step), header, fsync, rename, fsync the
        directory."""
        final = directory / chunk_file_name(header.chunk_start_number, version)
        temp = directory / f"{final.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}"
        size = chunk_file_size(header.chunk_data_size)
        renamed = False
        chunk = cls(
            final,
            header,
            None,
            version=version,
            data_end=0,
            record_count=0,
            max_record_size=max_record_size,
            on_map=on_map,
            alloc_step=alloc_step,
        )
        # Full size from the start, so positions and the footer's place never change; the
        # blocks past the first step are allocated as the writer nears them (reserve()).
        first = size
        if alloc_step:
            first = min(_round_page(HEADER_SIZE + min(alloc_step, _MIN_STEP)), size)
        try:
            fd = open_fd(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                if not _allocate(fd, 0, first):
                    first = size  # no fallocate here: a sparse file, as before
                    os.ftruncate(fd, size)
                elif first < size:
                    os.ftruncate(fd, size)
                os.pwrite(fd, header.pack(), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if final.exists():
                raise FileExistsError(errno.EEXIST, "chunk file exists already", str(final))
            os.rename(temp, final)
            renamed = True
            fsync_directory(directory)
            chunk.open_for_write()
            chunk.writable_end = min(first - HEADER_SIZE, chunk.data_size)
        except OSError as exc:
            # Undo it all, so that a retry (once space is freed) starts from nothing:
            # a chunk file left behind would block the next creation.
            chunk.close()
            (final if renamed else temp).unlink(missing_ok=True)
            raise write_error(exc, "creating a chunk", final) from exc
        return chunk

    # --- mapping -------------------------------------------------------------

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
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._mm = mm
            self.last_used = next(_ticks)
            self._on_map(self)
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
            self.on_advance(self)

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

    # --- writing -------------------------------------------------------------

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

    def try_append(self, record: bytes) -> int:
        """Append one variable-size record; its chunk-relative offset, or -1 if it does not fit.

        Only for a chunk open for writing; the caller (ChunkWriter) has checked the record.
        """
        n = len(record)
        offset = self.data_end
        end = offset + n + FRAME_OVERHEAD
        if end > self.writable_end:
            if end > self.data_size:
                return -1
            self.reserve(end)
        pack = _FRAME_PACKERS.get(n) or frame_packer(n)
        pack(self._mm, HEADER_SIZE + offset, n, record, _xxh3(record) & CHECKSUM_MASK, n)
        self.record_count += 1
        self.data_end = end  # publish last: readers check data_end first
        if end > self._prefault_mark:
            self._prefault(end)
        return offset

    def write_frame_at(self, offset: int, record: bytes) -> int:
        """Batch appends, step 1: frame ``record`` at data offset ``offset`` (at or past
        ``data_end``) without publishing it; returns the offset after it. The caller
        (holding the write lock) has checked that it fits."""
        n = len(record)
        pack = _FRAME_PACKERS.get(n) or frame_packer(n)
        pack(self._mm, HEADER_SIZE + offset, n, record, _xxh3(record) & CHECKSUM_MASK, n)
        return offset + n + FRAME_OVERHEAD

    def publish(self, end: int, count: int) -> None:
        """Batch appends, step 2: make the ``count`` records written up to ``end`` visible."""
        self.record_count += count
        self.data_end = end
        if end > self._prefault_mark:
            self._prefault(end)

    def try_append_fixed(self, record: bytes) -> int:
        offset = self.data_end
        end = offset + len(record)
        if end > self.writable_end:
            if end > self.data_size:
                return -1
            self.reserve(end)
        self._mm[HEADER_SIZE + offset : HEADER_SIZE + end] = record  # type: ignore[index]
        self.record_count += 1
        self.data_end = end
        if end > self._prefault_mark:  # as try_append: the window ahead, and release behind
            self._prefault(end)
        return offset

    @property
    def unflushed_bytes(self) -> int:
        return self.data_end - self.flushed_end

    def flush(self, *, settle: bool = False) -> None:
        """Make everything up to ``data_end`` durable.

        Safe beside the writing thread: it flushes at least what was committed
        when it was called. Several callers queue on one fdatasync at a time,
        and a caller whose data a previous fdatasync covered returns at once.
        ``settle`` also syncs what recovery found at open and counted as flushed
        (past ``synced_end``): not on the open's path, where it would write back
        every dirty page a crashed writer left, but soon after.
        """
        end = self.data_end
        if end <= (self.synced_end if settle else self.flushed_end):
            return
        with self._flush_lock:
            if end <= (self.synced_end if settle else self.flushed_end) or self._fd < 0:
                return
            end = self.data_end  # everything committed by now is covered too
            self._fdatasync("flushing a chunk")
            self.flushed_end = self.synced_end = end
        self._release(end)  # now flushed: a window behind it may go

    def _fdatasync(self, what: str) -> None:
        """fdatasync, under ``_flush_lock``; after one failure, every later call fails.

        After a failed fdatasync Linux may mark the pages clean without having written
        them, drop them, or (ext4, in a preallocated file like every chunk) leave their
        blocks unwritten, so that a later write of the same bytes and an fdatasync that
        succeeds still read back zeros once the page cache is dropped (a review showed it
        on a real failing ext4; docs/durability.md). No later flush of this
        chunk can vouch for the range, so none is claimed: the store is to be reopened,
        and recovery verifies every record written since the last checkpoint (no later
        one can be written) and cuts at the first damaged one. PostgreSQL
        made the same choice after "fsyncgate"."""
        if self._failed is not None:
            start, reason, failure = self._failed
            # The same class and errno: a full disk stays a DiskFullError.
            raise type(failure)(
                failure.errno,
                f"{what} refused for {self.path}: an earlier fdatasync of it failed "
                f"({reason}) with the data from offset {start:#x} on (or its footer) not "
                "yet durable, and no later flush can make them durable; close and reopen "
                "the store (recovery verifies every record written since the last checkpoint "
                "and cuts at the first damaged one)",
            )
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            failure = write_error(exc, what, self.path)
            self._failed = (self.flushed_end, exc.strerror or str(exc), failure)
            if self.on_sync_failure is not None:
                self.on_sync_failure()
            raise failure from exc

    def complete(self) -> ChunkFooter:
        """Flush the data, then write and flush the footer; the chunk is immutable after."""
        if self.footer is not None:
            return self.footer
        mm = self._mm
        assert mm is not None and self._writable, "complete() on a chunk not open for writing"
        self.flush()
        checksum = chunk_checksum(
            self._hashed,
            mm,
            HEADER_SIZE + self.data_end,
            self._window,
            lambda at: self._release(at - HEADER_SIZE),
        )
        first, last = footer_timestamps(mm, self.header, self.data_end, self.record_count)
        footer = ChunkFooter(
            completed=True,
            physical_data_size=self.data_end,
            logical_data_size=self.data_end,
            map_entry_count=0,
            record_count=self.record_count,
            first_timestamp=first,
            last_timestamp=last,
            checksum=checksum,
        )
        at = len(mm) - FOOTER_SIZE
        try:  # the footer's block (a hole until now), so writing it cannot meet a full disk
            _allocate(self._fd, at, FOOTER_SIZE)
        except OSError as exc:
            what = f"allocating the footer {location(None, at)}"
            raise write_error(exc, what, self.path) from exc
        mm[at:] = footer.pack()
        with self._flush_lock:
            try:
                self._fdatasync("writing a chunk footer")
            except StoreWriteError:
                mm[at:] = bytes(FOOTER_SIZE)
                raise
        self.synced_end = self.data_end
        self.footer = footer
        if self._alloc_step:
            # The blocks allocated ahead of the data are not needed any more (space.py);
            # first the prefaulter lets go, so it cannot fault the hole back in.
            if self._address:
                PREFAULTER.forget(self._address)
            start = _round_page(HEADER_SIZE + self.data_end)
            punch_hole(self._fd, start, (at // _PAGE * _PAGE) - start)
        return footer

    # --- reading -------------------------------------------------------------

    def physical_offset(self, local: int) -> int:
        """Where the record at chunk-relative logical offset ``local`` starts in the data area."""
        if not self.header.compacted:
            if not 0 <= local < self.data_end:
                raise PositionNotFoundError(
                    f"position {self.start_position + local} lies past the end of the data "
                    f"({self.start_position + self.data_end}) in {self.path}"
                )
            size = self.header.record_size
            if size and local % size:
                # A position off the record grid names no record; reading there would
                # return bytes straddling two records (or past data_end).
                raise PositionNotFoundError(
                    f"position {self.start_position + local} is not at a record boundary "
                    f"(record_size={size}) in {self.path}"
                )
            return local
        return self._map_lookup(local)

    def _map_lookup(self, local: int) -> int:
        footer = self.footer
        assert footer is not None, "compacted chunks are always completed"
        if not 0 <= local < footer.logical_data_size:
            raise PositionNotFoundError(
                f"position {self.start_position + local} lies outside compacted chunk {self.path}"
            )
        mm = self.mapping()
        base = HEADER_SIZE + footer.physical_data_size
        lo, hi = 0, footer.map_entry_count
        while lo < hi:
            mid = (lo + hi) // 2
            logical, physical = MAP_ENTRY.unpack_from(mm, base + mid * MAP_ENTRY_SIZE)
            if logical < local:
                lo = mid + 1
            elif logical > local:
                hi = mid
            else:
                return int(physical)
        if lo > 0:  # inside the survivor before it: not a record start, never a record
            logical, physical = MAP_ENTRY.unpack_from(mm, base + (lo - 1) * MAP_ENTRY_SIZE)
            (length,) = _unpack_prefix(mm, HEADER_SIZE + physical)
            if local < logical + length + FRAME_OVERHEAD:
                raise PositionNotFoundError(
                    f"position {self.start_position + local} lies inside the record at "
                    f"{self.start_position + logical} in {self.path}"
                )
        # The map keeps survivors only, so a position in a gap is reported as removed
        # even if it was inside a removed record rather than at its start.
        raise CompactedAwayError(
            f"the record at position {self.start_position + local} was removed by compaction "
            f"(chunk {self.path})"
        )

    def read_at(self, local: int) -> bytes:
        """The payload of the record at chunk-relative logical offset ``local``."""
        physical = self.physical_offset(local)
        self.last_used = next(_ticks)
        mm = self._mm or self.mapping()
        size = self.header.record_size
        if size:
            return mm[HEADER_SIZE + physical : HEADER_SIZE + physical + size]
        return self._read_frame(mm, physical)

    def read_many(self, offsets: list[int]) -> list[bytes]:
        """``read_at`` for several records (a pull's run of queue entries) in one loop.

        Any record that is not a valid, checksummed frame at its offset is read
        again through ``read_at``, which raises the precise error.
        """
        if self.header.compacted or self.header.record_size:
            return [self.read_at(local) for local in offsets]
        self.last_used = next(_ticks)
        mm = self._mm or self.mapping()
        end = HEADER_SIZE + self.physical_end
        unpack_prefix, unpack_suffix, xxh3 = _unpack_prefix, _unpack_suffix, _xxh3
        payloads = []
        for local in offsets:
            p = HEADER_SIZE + local
            if local >= 0 and p + FRAME_OVERHEAD <= end:
                (n,) = unpack_prefix(mm, p)
                q = p + FRAME_PREFIX_SIZE + n
                if n > 0 and q + FRAME_SUFFIX.size <= end:
                    payload = mm[p + FRAME_PREFIX_SIZE : q]
                    checksum, suffix = unpack_suffix(mm, q)
                    if suffix == n and xxh3(payload) & CHECKSUM_MASK == checksum:
                        payloads.append(payload)
                        continue
            payloads.append(self.read_at(local))  # raises what is wrong there
        return payloads

    @property
    def physical_end(self) -> int:
        """Bytes of the data area in use: the footer's, or what the writer published."""
        return self.footer.physical_data_size if self.footer is not None else self.data_end

    def corrupt_record(self, physical: int) -> CorruptRecordError:
        mm = self._mm or self.mapping()
        end = HEADER_SIZE + self.physical_end
        problem = frame_problem(mm, HEADER_SIZE + physical, end, self._max_record_size)
        reason, expected, found = problem or ("no record starts here", None, None)
        return CorruptRecordError(
            f"invalid record at position {self.start_position + physical}: {reason}",
            file=self.path,
            offset=HEADER_SIZE + physical,
            expected=expected,
            found=found,
        )

    def iter_records(self, local: int, base: int = 0) -> Records:
        """(``base`` + logical offset, payload) from chunk-relative ``local`` on, up to the
        committed end; returns the chunk-relative offset after the last record yielded.

        Yielding ``base``-shifted positions lets ChunkReader delegate with ``yield from``
        instead of re-yielding every record through a second generator.
        """
        self.last_used = next(_ticks)
        if self.header.compacted:
            return (yield from self._iter_compacted(local, base))
        if self.header.record_size:
            return (yield from self._iter_fixed(local, base))
        return (yield from self._iter_variable(local, base))

    def _iter_variable(self, local: int, base: int) -> Records:
        mm = self._mm or self.mapping()
        unpack_prefix, unpack_suffix, xxh3 = _unpack_prefix, _unpack_suffix, _xxh3
        completed = self.footer is not None
        limit = HEADER_SIZE + self.data_end
        p = HEADER_SIZE + local
        shift = base - HEADER_SIZE
        while p < limit or (not completed and p < HEADER_SIZE + self.data_end):
            if not completed:
                limit = HEADER_SIZE + self.data_end  # the writer may have committed more
            (n,) = unpack_prefix(mm, p)
            q = p + 4 + n
            if n == 0 or q + 8 > limit:
                raise self.corrupt_record(p - HEADER_SIZE)
            payload = mm[p + 4 : q]
            checksum, suffix = unpack_suffix(mm, q)
            if suffix != n or xxh3(payload) & CHECKSUM_MASK != checksum:
                raise self.corrupt_record(p - HEADER_SIZE)
            yield p + shift, payload
            p = q + 8
        return p - HEADER_SIZE

    def _iter_fixed(self, local: int, base: int) -> Records:
        mm = self._mm or self.mapping()
        size = self.header.record_size
        # Round a position off the record grid up, not down: iteration yields records
        # at or after ``local``, never the one that starts before it.
        offset = -(-local // size) * size
        while offset < self.data_end:
            p = HEADER_SIZE + offset
            yield base + offset, mm[p : p + size]
            offset += size
        return offset

    def _iter_compacted(self, local: int, base: int) -> Records:
        footer = self.footer
        assert footer is not None
        mm = self.mapping()
        map_at = HEADER_SIZE + footer.physical_data_size  # not ``base``: the positions' base
        lo, hi = 0, footer.map_entry_count
        while lo < hi:  # first entry at or after `local`
            mid = (lo + hi) // 2
            if MAP_ENTRY.unpack_from(mm, map_at + mid * MAP_ENTRY_SIZE)[0] < local:
                lo = mid + 1
            else:
                hi = mid
        size = self.header.record_size
        for index in range(lo, footer.map_entry_count):
            logical, physical = MAP_ENTRY.unpack_from(mm, map_at + index * MAP_ENTRY_SIZE)
            if size:
                yield base + logical, mm[HEADER_SIZE + physical : HEADER_SIZE + physical + size]
            else:
                yield base + logical, self._read_frame(mm, physical)
        return footer.logical_data_size

    def _read_frame(self, mm: mmap.mmap, physical: int) -> bytes:
        p = HEADER_SIZE + physical
        (n,) = _unpack_prefix(mm, p)
        q = p + FRAME_PREFIX_SIZE + n
        if n > 0 and q + FRAME_SUFFIX.size <= HEADER_SIZE + self.physical_end:
            payload = mm[p + FRAME_PREFIX_SIZE : q]
            checksum, suffix = _unpack_suffix(mm, q)
            if suffix == n and record_checksum(payload) == checksum:
                return payload
        raise self.corrupt_record(physical)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        self._end_writing()
        self._close_fd()
        if mm is not None:
            # A reader may still hold a view; then the mapping dies with it.
            with contextlib.suppress(BufferError):
                mm.close()


def _round_page(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
