"""Pass 2 of compaction, in plain Python: stream completed chunks once and write their
survivors to a compacted chunk, with a position map.

The output keeps every surviving record's bytes and logical position; only
its physical place changes, which the position map records. The file is
written and fsynced in the staging directory; installing it is commit.py's job.

Two ways to write a replacement: ``rewrite_group`` streams all its chunks in one
process, start to end; or each chunk of a merged replacement is written by its
own task (``write_part``) into the region the plan gives it (pass 1 knows every
chunk's surviving bytes and records, so every region is known before any is
written), and ``finish_merged`` then adds the header and the footer with the
checksum, reading the file back once.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import xxhash

from equeue.chunks.stream import BLOCK_SIZE, ChunkFile
from equeue.errors import CompactionError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAP_ENTRY,
    MAP_ENTRY_SIZE,
    TIMESTAMP,
    ChunkFooter,
    ChunkHeader,
    ChunkType,
    chunk_file_name,
)
from equeue.safepath import open_file

_WRITE_BUFFER: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class RewriteResult:
    file_name: str  # in the staging directory, and its final name in the chunk directory
    start_number: int
    end_number: int
    version: int
    bytes_before: int  # file sizes of the chunks replaced
    bytes_after: int
    records_kept: int
    records_removed: int


class CompactedChunkWriter:
    """Builds one compacted chunk file: header, surviving frames, position map, footer.

    The data checksum (xxh3_64 of header + data + map) is computed as the bytes go
    out, so nothing is read back; the map is held in memory, 12 bytes per survivor.
    """

    def __init__(
        self,
        path: Path,
        *,
        start_number: int,
        end_number: int,
        chunk_data_size: int,
        timestamp_offset: int | None,
    ) -> None:
        self.path = path
        self.header = ChunkHeader(
            chunk_type=ChunkType.VARIABLE,
            chunk_start_number=start_number,
            chunk_end_number=end_number,
            chunk_data_size=chunk_data_size,
            chunk_id=uuid.uuid4(),
            compacted=True,
            timestamp_offset=timestamp_offset,
            created_at_ns=time.time_ns(),
        )
        self._capacity = chunk_data_size * (end_number - start_number + 1)
        self._ts_offset = timestamp_offset
        self._file = open_file(path, "xb", buffering=_WRITE_BUFFER)  # closed in finish
        self._hash = xxhash.xxh3_64()
        self._map = bytearray()
        self._physical = 0
        self._count = 0
        self._first_ts: int | None = None
        self._last_ts: int | None = None
        self._write(self.header.pack())

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def add_block(self, kept: Kept, logical_base: int) -> None:
        """Append survivors, in order; ``logical_base``: their chunk's offset from the start."""
        if self._physical + kept.size > self._capacity:
            raise CompactionError(
                f"compacted data outgrows the {self._capacity} bytes of chunks "
                f"{self.header.chunk_start_number}..{self.header.chunk_end_number}",
                file=self.path,
                offset=HEADER_SIZE + self._physical,
            )
        self._map += kept.map_entries(logical_base, self._physical)
        for run in kept.runs:
            self._write(run)
        self._physical += kept.size
        self._count += len(kept.sizes)
        if kept.first_timestamp is not None:
            if self._first_ts is None:
                self._first_ts = kept.first_timestamp
            self._last_ts = kept.last_timestamp

    def finish(self, logical_end: int) -> int:
        """Write the map and footer, fsync; returns the file size."""
        try:
            self._write(self._map)
            footer = ChunkFooter(
                completed=True,
                physical_data_size=self._physical,
                logical_data_size=logical_end,
                map_entry_count=self._count,
                record_count=self._count,
                first_timestamp=self._first_ts,
                last_timestamp=self._last_ts,
                checksum=self._hash.intdigest(),
            )
            self._file.write(footer.pack())
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return HEADER_SIZE + self._physical + len(self._map) + FOOTER_SIZE

    def abandon(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    @property
    def count(self) -> int:
        return self._count


@dataclass(frozen=True, slots=True)
class Kept:
    """The survivors among one block's frames: runs of consecutive frames, copied as read
    (each was checked on the way in, and a frame's bytes depend only on its payload)."""

    runs: list[memoryview]
    logicals: np.ndarray  # int64, relative to their chunk's start
    sizes: np.ndarray  # int64 frame sizes
    first_timestamp: int | None
    last_timestamp: int | None

    @property
    def size(self) -> int:
        return int(self.sizes.sum())

    def map_entries(self, logical_base: int, physical: int) -> bytes:
        """Their position-map entries, the first frame at data offset ``physical``."""
        entries = np.empty(len(self.sizes), _MAP_ROW)
        entries["logical"] = logical_base + self.logicals
        entries["physical"] = physical + np.cumsum(self.sizes) - self.sizes
        return entries.tobytes()


_MAP_ROW: Final = np.dtype([("logical", "<u8"), ("physical", "<u4")])
assert _MAP_ROW.itemsize == MAP_ENTRY_SIZE and MAP_ENTRY.format == "<QI"


def kept_blocks(
    chunk: ChunkFile, removed: np.ndarray, drop: list[int], block_size: int = BLOCK_SIZE
) -> Iterator[Kept]:
    """The survivors of ``chunk``, a block at a time; ``removed`` are global positions,
    ascending (one that is not a record start removes nothing). Adds to ``drop[0]`` the
    records left out."""
    start = chunk.header.start_position
    ts_offset = chunk.header.timestamp_offset
    for at, buf, packed, logicals in chunk.frame_blocks(block_size):
        offsets = np.frombuffer(packed, "<i8")
        logical = at + offsets if logicals is None else np.frombuffer(logicals, "<i8")
        if len(removed):
            where = np.minimum(np.searchsorted(removed, start + logical), len(removed) - 1)
            goes = removed[where] == start + logical
        else:
            goes = np.zeros(len(offsets), np.bool_)
        drop[0] += int(goes.sum())
        kept = offsets[~goes]
        if len(kept) == 0:
            continue
        data = np.frombuffer(buf, np.uint8)
        sizes = data[kept[:, None] + np.arange(FRAME_PREFIX_SIZE)].view("<u4").ravel()
        sizes = sizes.astype(np.int64) + FRAME_OVERHEAD
        ends = kept + sizes
        # A run breaks where a kept frame does not start where the previous one ended.
        breaks = np.flatnonzero(kept[1:] != ends[:-1]) + 1
        firsts = np.concatenate(([0], breaks))
        lasts = np.concatenate((breaks, [len(kept)])) - 1
        view = memoryview(buf)
        runs = [view[s:e] for s, e in zip(kept[firsts].tolist(), ends[lasts].tolist(), strict=True)]
        first_ts = last_ts = None
        if ts_offset is not None:
            at_ts = FRAME_PREFIX_SIZE + ts_offset
            (first_ts,) = TIMESTAMP.unpack_from(buf, int(kept[0]) + at_ts)
            (last_ts,) = TIMESTAMP.unpack_from(buf, int(kept[-1]) + at_ts)
        yield Kept(runs, logical[~goes], sizes, first_ts, last_ts)


def rewrite_group(
    chunks: list[ChunkFile],
    removed: Iterable[int],
    staging: Path,
    version: int,
    block_size: int = BLOCK_SIZE,
) -> RewriteResult:
    """Write the survivors of consecutive completed ``chunks`` to one compacted chunk
    covering all their numbers; ``removed`` are the global positions to leave out, ascending.
    """
    first, last = chunks[0].header, chunks[-1].header
    for prev, chunk in itertools.pairwise(chunks):
        if chunk.header.chunk_start_number != prev.header.chunk_end_number + 1:
            raise CompactionError(
                f"chunks to merge are not consecutive: {prev.path.name} then {chunk.path.name}",
                file=chunk.path,
            )
    for chunk in chunks:
        if chunk.footer is None:
            raise CompactionError("only completed chunks are compacted", file=chunk.path)
    gone = ascending(removed)
    data_size = first.chunk_data_size
    base = first.start_position
    name = chunk_file_name(first.chunk_start_number, version)
    writer = CompactedChunkWriter(
        staging / name,
        start_number=first.chunk_start_number,
        end_number=last.chunk_end_number,
        chunk_data_size=data_size,
        timestamp_offset=first.timestamp_offset,
    )
    drop = [0]
    try:
        for chunk in chunks:
            for kept in kept_blocks(chunk, gone, drop, block_size):
                writer.add_block(kept, chunk.header.start_position - base)
        logical_end = last.start_position - base + chunks[-1].logical_end
        size = writer.finish(logical_end)
    except BaseException:
        writer.abandon()
        raise
    return RewriteResult(
        file_name=name,
        start_number=first.chunk_start_number,
        end_number=last.chunk_end_number,
        version=version,
        bytes_before=sum(c.path.stat().st_size for c in chunks),
        bytes_after=size,
        records_kept=writer.count,
        records_removed=drop[0],
    )


def ascending(positions: Iterable[int]) -> np.ndarray:
    """The removed positions as an array; CompactionError unless they ascend."""
    array = positions if isinstance(positions, np.ndarray) else np.fromiter(positions, np.int64)
    wrong = np.flatnonzero(array[1:] <= array[:-1])
    if len(wrong):
        raise CompactionError(
            f"removed positions must ascend: {array[wrong[0] + 1]} came after {array[wrong[0]]}"
        )
    return array


@dataclass(frozen=True, slots=True)
class Part:
    """One chunk of a merged replacement and the region the plan gives its survivors."""

    path: str  # the chunk file
    data_end: int
    file: str  # the replacement, in the staging directory (created at its final size)
    logical_base: int  # the chunk's start position minus the replacement's
    data_at: int  # offset of its first surviving frame in the replacement's data
    map_at: int  # file offset of its first position-map entry
    kept_bytes: int
    kept_count: int


@dataclass(frozen=True, slots=True)
class PartResult:
    kept_count: int
    kept_bytes: int
    removed_count: int
    first_timestamp: int | None
    last_timestamp: int | None


def write_part(part: Part, removed: Iterable[int], block_size: int = BLOCK_SIZE) -> PartResult:
    """Write the survivors of one chunk and their position-map entries into its regions of
    the replacement, and fsync; ``removed`` are global positions, ascending. Refuses,
    writing nothing past its regions, if the survivors are not what the plan said. Running
    it again (a retried task) writes the same bytes."""
    gone = ascending(removed)
    chunk = ChunkFile.open(part.path, part.data_end)
    if chunk.footer is None:
        raise CompactionError("only completed chunks are compacted", file=chunk.path)
    drop = [0]
    entries = bytearray()
    physical = count = 0
    first_ts: int | None = None
    last_ts: int | None = None
    with open_file(part.file, "r+b", buffering=_WRITE_BUFFER) as out:
        out.seek(HEADER_SIZE + part.data_at)
        for kept in kept_blocks(chunk, gone, drop, block_size):
            if physical + kept.size > part.kept_bytes:
                raise CompactionError(
                    f"the survivors of {chunk.path.name} outgrow the {part.kept_bytes} bytes "
                    "the plan gave them: the chunk changed under the job",
                    file=part.file,
                    offset=HEADER_SIZE + part.data_at + physical,
                )
            entries += kept.map_entries(part.logical_base, part.data_at + physical)
            for run in kept.runs:
                out.write(run)
            physical += kept.size
            count += len(kept.sizes)
            if kept.first_timestamp is not None:
                first_ts = kept.first_timestamp if first_ts is None else first_ts
                last_ts = kept.last_timestamp
        if (physical, count) != (part.kept_bytes, part.kept_count):
            raise CompactionError(
                f"{chunk.path.name} has {count} survivors of {physical} bytes, the plan said "
                f"{part.kept_count} of {part.kept_bytes}: the chunk changed under the job",
                file=part.file,
                offset=HEADER_SIZE + part.data_at,
            )
        out.seek(part.map_at)
        out.write(entries)
        out.flush()
        os.fsync(out.fileno())
    return PartResult(count, physical, drop[0], first_ts, last_ts)


def finish_merged(
    path: Path, header: ChunkHeader, parts: list[PartResult], logical_end: int
) -> int:
    """Complete a replacement whose parts ``write_part`` wrote: header, then the footer
    with the checksum of header + data + map (read back once), fsync; returns its size."""
    physical = sum(p.kept_bytes for p in parts)
    count = sum(p.kept_count for p in parts)
    stamped = [p for p in parts if p.first_timestamp is not None]
    digest = xxhash.xxh3_64()
    packed = header.pack()
    digest.update(packed)
    end = HEADER_SIZE + physical + count * MAP_ENTRY_SIZE
    with open_file(path, "r+b", buffering=0) as f:
        f.write(packed)
        at = HEADER_SIZE
        while at < end:
            block = f.read(min(BLOCK_SIZE, end - at))
            if not block:
                raise CompactionError("a replacement is shorter than planned", file=path, offset=at)
            digest.update(block)
            at += len(block)
        footer = ChunkFooter(
            completed=True,
            physical_data_size=physical,
            logical_data_size=logical_end,
            map_entry_count=count,
            record_count=count,
            first_timestamp=stamped[0].first_timestamp if stamped else None,
            last_timestamp=stamped[-1].last_timestamp if stamped else None,
            checksum=digest.intdigest(),
        )
        f.write(footer.pack())
        os.fsync(f.fileno())
    return end + FOOTER_SIZE
