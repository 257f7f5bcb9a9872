"""Finding the valid end of an ongoing chunk, and cutting what lies past it.

Nothing is dropped silently: bytes cut from a chunk are first copied to a side
file under ``recovered/`` and logged with their file and offset, then zeroed,
so a later scan never mistakes them for records.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from equeue import speedups
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.prefault import WINDOW
from equeue.format.chunk import (
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    RECOVERED_DIR,
    frame_problem,
)
from equeue.safepath import ensure_dir, open_file

log = logging.getLogger("equeue.recovery")

_BLOCK = 1 << 20
# Recovery reads the log a step at a time and releases each step once read (here and in
# the store's re-dispatch): what it keeps mapped is bounded as the writer's window is.
SCAN_STEP = WINDOW
_PAGE = mmap.PAGESIZE
_ZEROS = bytes(_BLOCK)


@dataclass(frozen=True, slots=True)
class ScanResult:
    data_end: int
    record_count: int
    problem: str | None  # why the scan stopped early; None at a clean end


@dataclass(frozen=True, slots=True)
class TailHint:
    """Where the records of the ongoing chunk ``chunk_id`` ended, ``record_count`` of
    them, when the store last checkpointed: durable then, so the scan at open can start
    there instead of at the chunk's first record (see ``frame_ends_at``)."""

    chunk_id: uuid.UUID
    data_end: int
    record_count: int


def frame_ends_at(
    buf: mmap.mmap | bytes, data_offset: int, available: int, max_length: int
) -> bool:
    """Whether a valid frame ends exactly at ``data_offset`` of the data area.

    Read from its end (the length suffix), then checked as a scan checks it (prefix,
    suffix, checksum): a hint that is not a record boundary is refused, not trusted.
    """
    if data_offset == 0:
        return True
    if not FRAME_OVERHEAD < data_offset <= available:
        return False
    (length,) = FRAME_PREFIX.unpack_from(buf, HEADER_SIZE + data_offset - FRAME_PREFIX_SIZE)
    start = data_offset - FRAME_OVERHEAD - length
    if start < 0 or FRAME_PREFIX.unpack_from(buf, HEADER_SIZE + start)[0] != length:
        return False
    return frame_problem(buf, HEADER_SIZE + start, HEADER_SIZE + data_offset, max_length) is None


def names_chunk(hint: TailHint, chunk_id: uuid.UUID) -> bool:
    """The hint names this chunk and a record count records of that size can reach."""
    return hint.chunk_id == chunk_id and 0 < hint.record_count <= hint.data_end // (
        FRAME_OVERHEAD + 1
    )


def scan_start(
    hints: list[TailHint | None],
    chunk_id: uuid.UUID,
    buf: mmap.mmap | bytes,
    available: int,
    chunk_data_size: int,
) -> TailHint | None:
    """The hint at which the recovery scan of the ongoing chunk ``chunk_id`` starts (as
    ChunkManager._start_at_hint chooses it): of those naming it, where a valid frame
    ends, the furthest. None: the scan starts at its first record. Records before it are
    not scanned, so damage there is not cut (reads of the damaged record fail)."""
    valid = [
        h
        for h in hints
        if h is not None
        and names_chunk(h, chunk_id)
        and frame_ends_at(buf, h.data_end, available, chunk_data_size - FRAME_OVERHEAD)
    ]
    return max(valid, key=lambda h: h.data_end, default=None)


@dataclass(frozen=True, slots=True)
class TailCut:
    """Bytes recovery removed from a chunk file, and where a copy of them went."""

    file: str
    offset: int  # file offset of the first byte cut
    length: int
    side_file: str
    reason: str

    def __str__(self) -> str:
        return (
            f"cut {self.length} bytes from {self.file} at offset {self.offset} "
            f"(0x{self.offset:x}): {self.reason}; copy kept in {self.side_file}"
        )


def scan_variable(
    buf: mmap.mmap | bytes, available: int, max_record_size: int, start: int = 0
) -> ScanResult:
    """Walk framed records from ``start`` (a record boundary of the data area) until the
    first invalid one; ``record_count`` counts those walked.

    ``available`` is how much of the data area the file really holds.
    """
    unpack = FRAME_PREFIX.unpack_from
    end = HEADER_SIZE + available
    offset = start
    count = 0
    problem: str | None = None
    fast = speedups.SPEEDUPS
    if fast is not None:  # the valid frames at C speed; the loop below looks at where it stopped
        offset, count = _scan_in_steps(fast, buf, available, max_record_size, start)
    next_release = offset + SCAN_STEP
    while HEADER_SIZE + offset + FRAME_PREFIX.size <= end:
        p = HEADER_SIZE + offset
        (n,) = unpack(buf, p)
        if n == 0:
            break
        found = frame_problem(buf, p, end, max_record_size)
        if found is not None:
            problem = found[0]
            break
        count += 1
        offset += n + FRAME_OVERHEAD
        if offset >= next_release:  # without the C scan too, a step's pages at a time
            release_walked(buf, offset)
            next_release = offset + SCAN_STEP
    return ScanResult(offset, count, problem)


def release_walked(buf: mmap.mmap | bytes, offset: int) -> None:
    """Unmap the pages before data offset ``offset`` of a mapping a scan has walked: a
    reopen otherwise kept the whole last chunk resident (232 MiB measured). They stay in
    the page cache; a ``bytes`` buffer has nothing to release."""
    if isinstance(buf, mmap.mmap):
        buf.madvise(mmap.MADV_DONTNEED, 0, (HEADER_SIZE + offset) // _PAGE * _PAGE)


def _scan_in_steps(
    fast: ModuleType, buf: mmap.mmap | bytes, available: int, max_length: int, start: int
) -> tuple[int, int]:
    """``scan_frames`` a step at a time, each step's pages released once walked."""
    offset, count = start, 0
    while True:
        limit = min(available, offset + SCAN_STEP)
        after, walked = fast.scan_frames(buf, HEADER_SIZE, limit, max_length, offset)
        count += walked
        if limit == available:
            return after, count
        if after == offset:  # a bad frame, or one longer than a step: the rest in one go
            after, walked = fast.scan_frames(buf, HEADER_SIZE, available, max_length, offset)
            return after, count + walked
        offset = after
        release_walked(buf, offset)


def scan_fixed(
    buf: mmap.mmap | bytes, available: int, record_size: int, start: int = 0
) -> ScanResult:
    """Fixed-size records run until the first all-zero slot (zero means empty); the scan
    starts at ``start``, a slot boundary, and counts every slot before the end."""
    zero = bytes(record_size)
    usable = available - available % record_size
    # Slot-aligned steps, each released once searched: no slot straddles two steps.
    step = max(1, SCAN_STEP // record_size) * record_size
    data_end = usable
    rel = start
    while rel < usable and data_end == usable:
        stop = HEADER_SIZE + min(usable, rel + step)
        pos = HEADER_SIZE + rel
        while True:  # find() runs in C; only a zero run that straddles two slots costs a retry
            hit = buf.find(zero, pos, stop)
            if hit < 0:
                break
            if (hit - HEADER_SIZE) % record_size == 0:
                data_end = hit - HEADER_SIZE
                break
            pos = HEADER_SIZE + ((hit - HEADER_SIZE) // record_size + 1) * record_size
        rel = stop - HEADER_SIZE
        release_walked(buf, rel)
    count = data_end // record_size
    return ScanResult(data_end, count, None)


def nonzero_extent(fd: int, start: int, end: int) -> int:
    """One past the last non-zero byte in [start, end) of the file, or ``start`` if all zero.

    Ranges SEEK_DATA reports as holes are skipped. Preallocated, never-written
    ranges are such holes, but reading near them can bring zero pages into the
    page cache, which then count as data: the bound on recovery time is one
    chunk's read, not the store's size.
    """
    # Without this, each read's readahead fills the page cache past it with zero pages
    # of the preallocated (unwritten) tail, which SEEK_DATA then reports as data: the
    # scan marched through the whole rest of the chunk (0.46 s for 216 MiB, measured).
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_RANDOM)
    fast = speedups.SPEEDUPS
    end = min(end, os.fstat(fd).st_size)
    if fast is not None and end > start:
        # Mapped and scanned backwards in C: no copies, and the last range with a
        # non-zero byte ends the search.
        with mmap.mmap(fd, end, access=mmap.ACCESS_READ) as mm:
            for low, high in reversed(_data_ranges(fd, start, end)):
                while high > low:  # a step at a time, each released once found all zero
                    piece = max(low, (high - 1) // SCAN_STEP * SCAN_STEP)
                    found: int = fast.last_nonzero(mm, piece, high)
                    if found > piece:
                        return found
                    with contextlib.suppress(OSError):
                        aligned = piece // _PAGE * _PAGE
                        mm.madvise(mmap.MADV_DONTNEED, aligned, high - aligned)
                    high = piece
        return start
    last = start
    for pos, stop in _data_ranges(fd, start, end):
        while pos < stop:
            block = os.pread(fd, min(_BLOCK, stop - pos), pos)
            if not block:
                return last
            # Comparing with a zero block is a memcmp, several times faster than rstrip;
            # only a block holding something is stripped to find its last non-zero byte.
            if block != _ZEROS[: len(block)]:
                last = pos + len(block.rstrip(b"\0"))
            pos += len(block)
    return last


def _data_ranges(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The ranges of [start, end) that SEEK_DATA reports as data (all of it where the
    file system cannot tell)."""
    ranges = []
    pos = start
    while pos < end:
        try:
            low = os.lseek(fd, pos, os.SEEK_DATA)
            high = min(end, os.lseek(fd, low, os.SEEK_HOLE))
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos
                break
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            return [(start, end)]
        if low >= end:
            break
        ranges.append((low, high))
        pos = high
    return ranges


def make_side_dir(directory: Path) -> Path:
    """``directory/recovered``, created durably (its entry fsynced) if it is new."""
    side_dir = directory / RECOVERED_DIR
    if ensure_dir(side_dir):  # never through a link: the copies would land outside
        fsync_directory(directory)
    return side_dir


def cut_range(
    path: Path,
    fd: int,
    start: int,
    end: int,
    reason: str,
    *,
    copy_all: bool = False,
) -> TailCut | None:
    """Copy [start, last non-zero byte] to a side file, then zero it; None if already zero."""
    stop = end if copy_all else nonzero_extent(fd, start, end)
    if stop <= start:
        return None
    side_dir = make_side_dir(path.parent)
    side = side_dir / f"{path.name}.{start}.{time.time_ns()}.cut"
    with open_file(side, "xb") as out:
        pos = start
        while pos < stop:
            block = os.pread(fd, min(_BLOCK, stop - pos), pos)
            if not block:
                break
            out.write(block)
            pos += len(block)
        out.flush()
        os.fsync(out.fileno())
    fsync_directory(side_dir)  # the copy is durable before the bytes are zeroed
    # The zeros are durable before anything new is written here: records cut from the
    # tail must not come back behind newer ones, should a power cut keep the new bytes
    # but not the zeros.
    _write_zeros_durably(fd, start, stop)
    cut = TailCut(str(path), start, stop - start, str(side), reason)
    log.warning("recovery: %s", cut)
    return cut


def _write_zeros_durably(fd: int, start: int, stop: int) -> None:
    """Zeros over [start, stop), on stable storage when this returns. RWF_DSYNC (Linux
    4.7+) makes each write durable by itself; an fsync would also write back every dirty
    page a crashed writer left in the file (0.27 s measured at a reopen). Where the flag
    is refused, plain writes and one fsync."""
    dsync: int | None = getattr(os, "RWF_DSYNC", None)
    pos = start
    while pos < stop:
        size = min(_BLOCK, stop - pos)
        if dsync is not None:
            try:
                pos += os.pwritev(fd, [bytes(size)], pos, dsync)
                continue
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                dsync = None  # this file system or kernel: the fsync below
        pos += os.pwrite(fd, bytes(size), pos)
    if dsync is None:
        os.fsync(fd)
