"""On-disk layout of a chunk file. Every other module imports these names.

A chunk file is::

    [header 128 B][data area: chunk_data_size B][footer 128 B]            (ongoing or completed)
    [header 128 B][data: physical size][position map][footer 128 B]       (compacted)

Ongoing and completed chunks have their full size from creation and never
change size (their disk blocks are allocated in steps as the data grows: the
file is sparse past them, and reads there return zeros); the footer always
occupies the last 128 bytes of the file, so it is found without reading
anything else. All integers are little-endian.

Header (written once, at creation, before the file gets its final name)::

    offset size type    field
    0      4    bytes   magic b"EQCH"
    4      2    u16     format version (1)
    6      1    u8      chunk type: 0 = variable-size records, 1 = fixed-size records
    7      1    u8      flags: bit 0 compacted, bit 1 records carry a timestamp
    8      4    u32     record size (fixed-size chunks; 0 for variable-size)
    12     4    u32     timestamp offset: byte offset of an i64 (ns) inside each payload
    16     8    u64     chunk start number
    24     8    u64     chunk end number (== start unless compaction merged chunks)
    32     8    u64     chunk data size (per chunk number; positions are number * size + offset)
    40     16   bytes   chunk id (random UUID)
    56     8    i64     created at, ns since the epoch
    64     60   zero    reserved
    124    4    u32     xxh32 of bytes 0..123

Footer (written by ``complete()``; all zero while the chunk is ongoing)::

    offset size type    field
    0      4    bytes   magic b"EQFT"
    4      1    u8      flags: bit 0 completed
    5      3    zero    reserved
    8      8    u64     physical data size: bytes of the data area in use
    16     8    u64     logical data size: logical bytes covered (== physical unless compacted)
    24     8    u64     position-map entry count (0 unless compacted)
    32     8    u64     record count
    40     8    i64     first record timestamp (ns), or INT64_MIN when records have none
    48     8    i64     last record timestamp (ns), or INT64_MIN
    56     8    u64     xxh3_64 of header + data[0:physical] + position map
    64     60   zero    reserved
    124    4    u32     xxh32 of bytes 0..123 (the footer checks itself without reading data)

Variable-size record frame (at any data offset; records are packed back to back)::

    offset  size type   field
    0       4    u32    payload length n (1 <= n; a zero length marks the end of data)
    4       n    bytes  payload
    4+n     4    u32    low 32 bits of xxh3_64(payload)
    8+n     4    u32    payload length n again (lets a reader check the frame from either end)

Fixed-size records are ``record size`` bytes each with no framing; an all-zero
slot means "empty", so a valid fixed-size record is never all zero.

Position-map entry (compacted chunks; sorted by logical offset)::

    offset size type    field
    0      8    u64     logical offset of the record, relative to the chunk's start position
    8      4    u32     physical offset of its frame in the data area

File names: ``chunk-{start number:012d}.{version:04d}``; a compacted
replacement gets a higher version than the files it replaces, so loading keeps
the highest version that covers a chunk number. Temp files end in ``.tmp``.
A listed name is a chunk file only if it is exactly that: ASCII digits, nothing
after the version, not even a newline. Any other name in a chunk directory (one
with Arabic-Indic or fullwidth digits, or one ending in a newline) is ignored by
the store, ``verify`` and retention and left in place.
"""

from __future__ import annotations

import enum
import mmap
import re
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import xxhash

from equeue.errors import (
    ChecksumMismatchError,
    CorruptionError,
    NewerFormatError,
    TruncatedError,
)

FORMAT_VERSION: Final = 1
HEADER_MAGIC: Final = b"EQCH"
FOOTER_MAGIC: Final = b"EQFT"

HEADER_SIZE: Final = 128
FOOTER_SIZE: Final = 128

INT64_MIN: Final = -(1 << 63)
MAX_CHUNK_DATA_SIZE: Final = 1 << 31  # physical offsets in the position map are u32
MIN_CHUNK_DATA_SIZE: Final = 4096

_HEADER = struct.Struct("<4sHBBIIQQQ16sq60xI")
_FOOTER = struct.Struct("<4sB3xQQQQqqQ60xI")
assert _HEADER.size == HEADER_SIZE
assert _FOOTER.size == FOOTER_SIZE
_CHECKED_PREFIX: Final = HEADER_SIZE - 4  # both header and footer checksum their first 124 bytes
# The header's chunk id: random, written once when the file is made, so it tells one file
# under a chunk name from another made later under the same name (a topic deleted and
# made again): a view checks it whenever it opens a chunk's file by name again.
CHUNK_ID_OFFSET: Final = struct.calcsize("<4sHBBIIQQQ")
CHUNK_ID_SIZE: Final = 16
assert CHUNK_ID_OFFSET == 40

# Frame pieces, used directly on the hot paths.
FRAME_PREFIX: Final = struct.Struct("<I")
FRAME_SUFFIX: Final = struct.Struct("<II")  # checksum, length
FRAME_PREFIX_SIZE: Final = FRAME_PREFIX.size
FRAME_OVERHEAD: Final = FRAME_PREFIX.size + FRAME_SUFFIX.size
assert FRAME_OVERHEAD == 12
MAX_RECORD_LENGTH: Final = (1 << 32) - 1

MAP_ENTRY: Final = struct.Struct("<QI")
MAP_ENTRY_SIZE: Final = MAP_ENTRY.size
assert MAP_ENTRY_SIZE == 12

TIMESTAMP: Final = struct.Struct("<q")

# {:012d} / {:04d} are minimum widths, so longer numbers must parse too: a chunk past
# number 10**12 - 1 (or version 9999) would otherwise be skipped at load. [0-9], not \d
# (which matches "\u0663", and int() reads it as 3), and fullmatch, not "$" (which
# matches before a final "\n"): a name from a listing is checked as strictly as one
# the API makes, so only a name chunk_file_name() writes is taken for a chunk file.
CHUNK_FILE_RE: Final = re.compile(r"chunk-([0-9]{12,})\.([0-9]{4,})")
TEMP_SUFFIX: Final = ".tmp"
RECOVERED_DIR: Final = "recovered"


CHECKSUM_MASK: Final = 0xFFFFFFFF


def record_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload) & CHECKSUM_MASK


_FRAME_PACKERS: dict[int, Callable[..., None]] = {}
_FRAME_PACKERS_MAX: Final = 4096


def frame_packer(length: int) -> Callable[..., None]:
    """``pack_into(buffer, offset, length, payload, checksum, length)`` for one payload length.

    One precompiled Struct per length writes a whole frame in one call, twice
    as fast as three separate writes; the cache is bounded and simply reset
    when full.
    """
    packer = _FRAME_PACKERS.get(length)
    if packer is None:
        if len(_FRAME_PACKERS) >= _FRAME_PACKERS_MAX:
            _FRAME_PACKERS.clear()
        packer = _FRAME_PACKERS[length] = struct.Struct(f"<I{length}sII").pack_into
    return packer


def chunk_file_name(start_number: int, version: int = 0) -> str:
    return f"chunk-{start_number:012d}.{version:04d}"


def parse_chunk_file_name(name: str) -> tuple[int, int] | None:
    """(start number, version) for a chunk file name, None for any other name."""
    match = CHUNK_FILE_RE.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def chunk_file_size(chunk_data_size: int) -> int:
    return HEADER_SIZE + chunk_data_size + FOOTER_SIZE


class ChunkType(enum.IntEnum):
    VARIABLE = 0
    FIXED = 1


_FLAG_COMPACTED: Final = 1
_FLAG_TIMESTAMPS: Final = 2
_FLAG_COMPLETED: Final = 1


def _require(buf: bytes | memoryview, size: int, what: str, file: str, offset: int) -> None:
    if len(buf) < size:
        raise TruncatedError(
            f"short read of {what}: {len(buf)} of {size} bytes", file=file, offset=offset
        )


def _self_check(buf: bytes | memoryview, what: str, file: str, offset: int) -> None:
    stored = int.from_bytes(buf[_CHECKED_PREFIX:HEADER_SIZE], "little")
    computed = xxhash.xxh32_intdigest(bytes(buf[:_CHECKED_PREFIX]))
    if stored != computed:
        raise ChecksumMismatchError(
            f"{what} checksum mismatch", file=file, offset=offset, expected=stored, found=computed
        )


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    chunk_type: ChunkType
    chunk_start_number: int
    chunk_end_number: int
    chunk_data_size: int
    chunk_id: uuid.UUID
    record_size: int = 0
    compacted: bool = False
    timestamp_offset: int | None = None
    created_at_ns: int = 0
    version: int = FORMAT_VERSION

    @property
    def start_position(self) -> int:
        return self.chunk_start_number * self.chunk_data_size

    @property
    def end_position(self) -> int:
        return (self.chunk_end_number + 1) * self.chunk_data_size

    def pack(self) -> bytes:
        flags = (_FLAG_COMPACTED if self.compacted else 0) | (
            _FLAG_TIMESTAMPS if self.timestamp_offset is not None else 0
        )
        body = _HEADER.pack(
            HEADER_MAGIC,
            self.version,
            int(self.chunk_type),
            flags,
            self.record_size,
            self.timestamp_offset or 0,
            self.chunk_start_number,
            self.chunk_end_number,
            self.chunk_data_size,
            self.chunk_id.bytes,
            self.created_at_ns,
            0,
        )
        return body[:_CHECKED_PREFIX] + xxhash.xxh32_intdigest(body[:_CHECKED_PREFIX]).to_bytes(
            4, "little"
        )

    @classmethod
    def unpack(cls, buf: bytes | memoryview, *, file: str = "<memory>") -> ChunkHeader:
        _require(buf, HEADER_SIZE, "chunk header", file, 0)
        buf = buf[:HEADER_SIZE]
        magic = bytes(buf[:4])
        if magic != HEADER_MAGIC:
            raise CorruptionError(
                "not a chunk file (bad header magic)",
                file=file,
                offset=0,
                expected=HEADER_MAGIC,
                found=magic,
            )
        _self_check(buf, "chunk header", file, 0)
        (_, version, ctype, flags, rsize, ts_off, start, end, dsize, cid, created, _) = (
            _HEADER.unpack(buf)
        )
        reads = f"version {FORMAT_VERSION}"  # (its checksum holds: no damage, a newer one's)
        NewerFormatError.check(
            "chunk format version", version, FORMAT_VERSION, file=file, offset=4, reads=reads
        )
        if version != FORMAT_VERSION:
            raise CorruptionError(
                f"chunk format version {version}, but this equeue library reads version "
                f"{FORMAT_VERSION}",
                file=file,
                offset=4,
                expected=FORMAT_VERSION,
                found=version,
            )
        if ctype not in (ChunkType.VARIABLE, ChunkType.FIXED):
            raise CorruptionError("unknown chunk type", file=file, offset=6, found=ctype)
        if end < start:
            raise CorruptionError(
                f"chunk end number {end} is below start number {start}", file=file, offset=24
            )
        return cls(
            chunk_type=ChunkType(ctype),
            chunk_start_number=start,
            chunk_end_number=end,
            chunk_data_size=dsize,
            chunk_id=uuid.UUID(bytes=cid),
            record_size=rsize,
            compacted=bool(flags & _FLAG_COMPACTED),
            timestamp_offset=ts_off if flags & _FLAG_TIMESTAMPS else None,
            created_at_ns=created,
            version=version,
        )


@dataclass(frozen=True, slots=True)
class ChunkFooter:
    completed: bool
    physical_data_size: int
    logical_data_size: int
    map_entry_count: int
    record_count: int
    first_timestamp: int | None
    last_timestamp: int | None
    checksum: int

    def pack(self) -> bytes:
        body = _FOOTER.pack(
            FOOTER_MAGIC,
            _FLAG_COMPLETED if self.completed else 0,
            self.physical_data_size,
            self.logical_data_size,
            self.map_entry_count,
            self.record_count,
            INT64_MIN if self.first_timestamp is None else self.first_timestamp,
            INT64_MIN if self.last_timestamp is None else self.last_timestamp,
            self.checksum,
            0,
        )
        return body[:_CHECKED_PREFIX] + xxhash.xxh32_intdigest(body[:_CHECKED_PREFIX]).to_bytes(
            4, "little"
        )

    @classmethod
    def unpack(
        cls, buf: bytes | memoryview, *, file: str = "<memory>", offset: int = 0
    ) -> ChunkFooter:
        _require(buf, FOOTER_SIZE, "chunk footer", file, offset)
        buf = buf[:FOOTER_SIZE]
        magic = bytes(buf[:4])
        if magic != FOOTER_MAGIC:
            raise CorruptionError(
                "bad footer magic", file=file, offset=offset, expected=FOOTER_MAGIC, found=magic
            )
        _self_check(buf, "chunk footer", file, offset)
        _, flags, physical, logical, map_count, records, first, last, checksum, _ = _FOOTER.unpack(
            buf
        )
        return cls(
            completed=bool(flags & _FLAG_COMPLETED),
            physical_data_size=physical,
            logical_data_size=logical,
            map_entry_count=map_count,
            record_count=records,
            first_timestamp=None if first == INT64_MIN else first,
            last_timestamp=None if last == INT64_MIN else last,
            checksum=checksum,
        )

    @staticmethod
    def is_blank(buf: bytes | memoryview) -> bool:
        """True for the all-zero footer area of an ongoing chunk."""
        return not any(buf[:FOOTER_SIZE])


@dataclass(frozen=True, slots=True)
class PositionMapEntry:
    logical_offset: int
    physical_offset: int

    def pack(self) -> bytes:
        return MAP_ENTRY.pack(self.logical_offset, self.physical_offset)

    @classmethod
    def unpack(
        cls, buf: bytes | memoryview, *, file: str = "<memory>", offset: int = 0
    ) -> PositionMapEntry:
        _require(buf, MAP_ENTRY_SIZE, "position-map entry", file, offset)
        logical, physical = MAP_ENTRY.unpack_from(buf)
        return cls(logical, physical)


def frame_problem(
    buf: bytes | memoryview | mmap.mmap, offset: int, end: int, max_length: int
) -> tuple[str, int | None, int | None] | None:
    """Why the frame at ``offset`` (ending no later than ``end``) is invalid, or None.

    The answer is (reason, expected, found) so callers can raise or report it
    with their own file and position.
    """
    if offset + FRAME_OVERHEAD + 1 > end:
        return ("frame does not fit before the end of the data", None, None)
    (length,) = FRAME_PREFIX.unpack_from(buf, offset)
    if length == 0:
        return ("zero record length", None, 0)
    if length > max_length:
        return (f"record length above the maximum {max_length}", max_length, length)
    if offset + FRAME_OVERHEAD + length > end:
        return ("record runs past the end of the data", end - offset - FRAME_OVERHEAD, length)
    checksum, suffix = FRAME_SUFFIX.unpack_from(buf, offset + FRAME_PREFIX_SIZE + length)
    if suffix != length:
        return ("length suffix does not match length prefix", length, suffix)
    start = offset + FRAME_PREFIX_SIZE
    computed = record_checksum(memoryview(buf)[start : start + length])
    if computed != checksum:
        return ("record checksum mismatch", checksum, computed)
    return None
