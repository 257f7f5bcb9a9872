"""Message frames in a mapped chunk, for ``equeue verify``: finding the next valid
frame after damage, the position map of a compacted chunk, and how a frame problem
reads in a report."""

from __future__ import annotations

import mmap

from equeue.format.chunk import (
    FRAME_PREFIX_SIZE,
    FRAME_SUFFIX,
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    PositionMapEntry,
    frame_problem,
)
from equeue.format.message import RECORD_POSITION
from equeue.inspect.layout import ChunkFile

_POSITION = RECORD_POSITION


def frame_reason(found: tuple[str, int | None, int | None]) -> str:
    reason, expected, got = found
    if expected is None and got is None:
        return reason
    return f"{reason} (expected {show(expected)}, found {show(got)})"


def show(value: int | None) -> str:
    return "nothing" if value is None else f"0x{value:x}"


def suffix_length(mm: mmap.mmap, p: int, length: int) -> int:
    return int(FRAME_SUFFIX.unpack_from(mm, p + FRAME_PREFIX_SIZE + length)[1])


def resync(mm: mmap.mmap, start: int, stop: int, base: int, max_length: int) -> int | None:
    """The file offset of the first valid message frame in [start, stop), or None.

    A message record starts with its own log position (an i64), so a frame at file
    offset q must carry ``base + q - HEADER_SIZE`` there. Within one 64 KiB span of
    positions the top six bytes of that value are fixed, so a C-speed find() for them
    yields the few candidates worth a full frame check.
    """
    size = _POSITION.size
    q = start
    while q < stop:
        position = base + q - HEADER_SIZE
        span = min(stop, q + (((position >> 16) + 1) << 16) - position)
        high = _POSITION.pack(position)[2:]
        first = q + FRAME_PREFIX_SIZE + 2
        hit = mm.find(high, first, span + FRAME_PREFIX_SIZE + size)
        while hit >= 0:
            candidate = hit - FRAME_PREFIX_SIZE - 2
            value = _POSITION.unpack_from(mm, candidate + FRAME_PREFIX_SIZE)[0]
            if (
                value == base + candidate - HEADER_SIZE
                and frame_problem(mm, candidate, stop, max_length) is None
            ):
                return int(candidate)
            hit = mm.find(high, hit + 1, span + FRAME_PREFIX_SIZE + size)
        q = span
    return None


def map_lookup(mm: mmap.mmap, cf: ChunkFile, local: int) -> int | None:
    """Physical offset of a compacted chunk's record at logical ``local``; None if removed."""
    footer = cf.footer
    assert footer is not None
    base = HEADER_SIZE + footer.physical_data_size
    lo, hi = 0, footer.map_entry_count
    while lo < hi:
        mid = (lo + hi) // 2
        at = base + mid * MAP_ENTRY_SIZE
        entry = PositionMapEntry.unpack(mm[at : at + MAP_ENTRY_SIZE])
        if entry.logical_offset < local:
            lo = mid + 1
        elif entry.logical_offset > local:
            hi = mid
        else:
            return entry.physical_offset
    return None
