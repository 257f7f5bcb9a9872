from __future__ import annotations

from dataclasses import dataclass

from equeue.errors import ConfigError
from equeue.format.chunk import (
    FRAME_OVERHEAD,
    MAX_CHUNK_DATA_SIZE,
    MAX_RECORD_LENGTH,
    MIN_CHUNK_DATA_SIZE,
    TIMESTAMP,
    ChunkType,
)

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ChunkManagerConfig:
    """Settings of one chunk directory.

    ``chunk_data_size`` and ``record_size`` are written into every chunk header;
    reopening a directory with other values is refused, because positions are
    ``chunk number * chunk_data_size + offset``.

    ``sync_flush=True`` makes every ``ChunkWriter.write`` return only after its
    bytes are on stable storage (an msync per write): nothing acknowledged is
    lost even on power loss, at the cost of one device flush per write. With
    ``False`` a process crash loses nothing (the bytes are in the page cache),
    but a power loss or kernel crash loses what was written since the last
    ``flush()``.

    ``alloc_step`` is how far ahead of the writer a chunk's disk blocks are
    allocated (``posix_fallocate``), so that a write into the mapping never
    meets a full disk (SIGBUS) and a full disk is a ``DiskFullError`` before
    anything is written. The file has its full size from the start (sparse
    past what is allocated). A step starts at 64 KiB and doubles with the
    chunk's data up to ``alloc_step``: the disk holds the data plus at most
    about one step per chunk being written. What it risks: a smaller step
    costs an fallocate call more often (tens of µs each, under the write
    lock) and may fragment the file; a larger one leaves more unused space
    allocated. 0 allocates each chunk whole when it is created (the disk use
    of earlier versions: a 256 MiB chunk for one message).

    ``make_ahead`` has a thread make the next chunk's file while the current one
    fills (ahead.py), so that a roll-over renames it instead of creating it: one
    temporary file per directory more on disk (its first allocation step), and
    a roll-over that costs a rename instead of two fsyncs. The store sets it for
    the message log only.
    """

    chunk_data_size: int = 256 * MiB
    record_size: int = 0  # 0 = variable-size framed records
    max_record_size: int = 4 * MiB
    sync_flush: bool = False
    timestamp_offset: int | None = None  # where an i64 ns timestamp sits in each payload
    max_open_chunks: int = 8  # completed chunks kept mapped at once (an LRU)
    alloc_step: int = 4 * MiB
    make_ahead: bool = False

    def __post_init__(self) -> None:
        check_int("chunk_data_size", self.chunk_data_size, MIN_CHUNK_DATA_SIZE, MAX_CHUNK_DATA_SIZE)
        check_int("record_size", self.record_size, 0, self.chunk_data_size)
        check_int("max_record_size", self.max_record_size, 1, MAX_RECORD_LENGTH)
        check_int("max_open_chunks", self.max_open_chunks, 1, 1 << 16)
        check_int("alloc_step", self.alloc_step, 0, MAX_CHUNK_DATA_SIZE)
        if not isinstance(self.sync_flush, bool):
            raise ConfigError(f"sync_flush must be a bool, got {self.sync_flush!r}")
        if not isinstance(self.make_ahead, bool):
            raise ConfigError(f"make_ahead must be a bool, got {self.make_ahead!r}")
        if self.record_size and self.chunk_data_size % self.record_size:
            raise ConfigError(
                f"chunk_data_size={self.chunk_data_size} is not a multiple of "
                f"record_size={self.record_size}; fixed-size chunks hold whole records"
            )
        if self.timestamp_offset is not None:
            longest = self.record_size or self.max_record_size
            check_int("timestamp_offset", self.timestamp_offset, 0, longest - TIMESTAMP.size)

    @property
    def chunk_type(self) -> ChunkType:
        return ChunkType.FIXED if self.record_size else ChunkType.VARIABLE

    @property
    def largest_record(self) -> int:
        """The longest record a chunk of this configuration can take."""
        if self.record_size:
            return self.record_size
        return min(self.max_record_size, self.chunk_data_size - FRAME_OVERHEAD)


def check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range; it must lie in [{low}, {high}]")
