"""A chunk file's footer: reading it at open, with the checks a completed chunk must pass,
and the first and last timestamps ``Chunk.complete`` writes into it."""

from __future__ import annotations

import mmap
from pathlib import Path

from equeue.errors import CorruptionError, TruncatedError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    TIMESTAMP,
    ChunkFooter,
    ChunkHeader,
    chunk_file_size,
)
from equeue.safepath import open_file


def read_footer(path: Path, header: ChunkHeader, size: int, *, last: bool) -> ChunkFooter | None:
    """The footer of a completed chunk; None for the ongoing (last) chunk."""
    full = chunk_file_size(header.chunk_data_size)
    if size < HEADER_SIZE + FOOTER_SIZE or (not header.compacted and size != full):
        if last and not header.compacted:
            return None  # a short last chunk: scanned and extended by recovery
        raise TruncatedError(f"chunk file is {size} bytes, expected {full}", file=path, offset=size)
    at = size - FOOTER_SIZE
    with open_file(path, "rb") as f:
        f.seek(at)
        raw = f.read(FOOTER_SIZE)
    if last and ChunkFooter.is_blank(raw):
        return None
    try:
        footer = ChunkFooter.unpack(raw, file=str(path), offset=at)
        if not footer.completed:
            raise CorruptionError("footer without the completed flag", file=path, offset=at)
    except CorruptionError:
        if last and not header.compacted:
            return None  # torn footer on the last chunk: recovery cuts it and rescans
        raise
    if footer.physical_data_size > header.chunk_data_size * (
        header.chunk_end_number - header.chunk_start_number + 1
    ):
        raise CorruptionError(
            f"footer physical data size {footer.physical_data_size} exceeds the data area",
            file=path,
            offset=at + 8,
        )
    return footer


def footer_timestamps(
    mm: mmap.mmap, header: ChunkHeader, data_end: int, record_count: int
) -> tuple[int | None, int | None]:
    """The first and last records' timestamps of a chunk's data (None, None where its
    records carry none, or it has no record)."""
    ts_off = header.timestamp_offset
    if ts_off is None or record_count == 0:
        return None, None
    end = HEADER_SIZE + data_end
    if header.record_size:
        frame, last_start = 0, end - header.record_size
    else:  # the last frame's length suffix says where that frame starts
        (length,) = FRAME_PREFIX.unpack_from(mm, end - FRAME_PREFIX_SIZE)
        frame, last_start = FRAME_PREFIX_SIZE, end - length - FRAME_OVERHEAD
    (first,) = TIMESTAMP.unpack_from(mm, HEADER_SIZE + frame + ts_off)
    (last,) = TIMESTAMP.unpack_from(mm, last_start + frame + ts_off)
    return first, last
