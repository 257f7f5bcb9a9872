"""Pass 2 of compaction, in plain Python: stream consecutive completed chunks once and
write their survivors to one compacted chunk, with a position map.

The output keeps every surviving record's bytes and logical position; only
its physical place changes, which the position map records. The file is
written and fsynced in the staging directory; installing it is commit.py's job.
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

import xxhash

from equeue.chunks.stream import BLOCK_SIZE, ChunkFile
from equeue.errors import CompactionError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAP_ENTRY,
    TIMESTAMP,
    ChunkFooter,
    ChunkHeader,
    ChunkType,
    chunk_file_name,
    frame_packer,
    record_checksum,
)

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
        self._file = open(path, "xb", buffering=_WRITE_BUFFER)  # noqa: SIM115 - closed in finish
        self._hash = xxhash.xxh3_64()
        self._map = bytearray()
        self._physical = 0
        self._count = 0
        self._first_ts: int | None = None
        self._last_ts: int | None = None
        self._write(self.header.pack())

    def _write(self, data: bytes | bytearray) -> None:
        self._file.write(data)
        self._hash.update(data)

    def add(self, logical: int, payload: bytes) -> None:
        """Append the record at ``logical`` (relative to the start); calls come in order."""
        n = len(payload)
        frame = bytearray(n + FRAME_OVERHEAD)
        frame_packer(n)(frame, 0, n, payload, record_checksum(payload), n)
        if self._physical + len(frame) > self._capacity:
            raise CompactionError(
                f"compacted data outgrows the {self._capacity} bytes of chunks "
                f"{self.header.chunk_start_number}..{self.header.chunk_end_number}",
                file=self.path,
                offset=HEADER_SIZE + self._physical,
            )
        self._map += MAP_ENTRY.pack(logical, self._physical)
        self._write(frame)
        self._physical += len(frame)
        self._count += 1
        if self._ts_offset is not None:
            (ts,) = TIMESTAMP.unpack_from(payload, self._ts_offset)
            if self._first_ts is None:
                self._first_ts = ts
            self._last_ts = ts

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
    dropped = 0
    try:
        pending = _ascending(iter(removed))
        next_removed = next(pending, None)
        for chunk in chunks:
            offset = chunk.header.start_position - base
            for logical, payload in chunk.records(block_size):
                position = base + offset + logical
                while next_removed is not None and next_removed < position:
                    next_removed = next(pending, None)  # not a record start: nothing to drop
                if next_removed == position:
                    dropped += 1
                    continue
                writer.add(offset + logical, payload)
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
        records_removed=dropped,
    )


def _ascending(positions: Iterator[int]) -> Iterator[int]:
    previous = -1
    for position in positions:
        if position <= previous:
            raise CompactionError(
                f"removed positions must ascend: {position} came after {previous}"
            )
        previous = position
        yield position
