"""On-disk layout of ``topics.journal``: the topic changes made since topics.json was
last written, one record per ``create_topic`` or ``delete_topic``, appended and
fdatasynced (equeue/store/topicsfile.py writes and reads it).

topics.json is replaced atomically (a temporary file, its fsync, a rename, the
directory's fsync): two fsyncs a change. A record appended here costs one fdatasync;
topics.json is rewritten only when the journal outgrows its bound, at a writable open
that finds records, and at a clean close ("folding"). Each record holds a topic's whole
entry as topics.json would (its queue count, its policy, its deletion), never a
difference.

Each fold has a generation, written into topics.json (a top-level ``"generation"``,
none meaning 0, checksummed: equeue/format/topicsjson.py) and into the fresh journal's
header. A journal whose generation is below topics.json's was folded into it already (a
crash, or a failed write, between a fold's topics.json and its fresh journal; or a
reader between the two renames): it is
not replayed (its records could be older than the file's entry for the topic the fold
changed), and a writer's open replaces it.

File (little-endian)::

    offset size type    field
    0      8    bytes   magic b"EQTOPJ01"
    8      4    u32     format version (2)
    12     8    u64     generation: that of the topics.json this journal follows
    20     4    u32     xxh32 of bytes 0..19
    24     ...  records, back to back, up to the end of the file

Version 1 (written by the first equeue with the journal) had no generation (bytes
12..15 its checksum, records from 16): it reads as generation 0.

Record (40 + n bytes)::

    offset size type    field
    0      4    u32     xxh32 of bytes 4 .. the record's end
    4      4    u32     size of the whole record: 40 + n
    8      1    u8      flags: bit 0 queue count set, bit 1 deleted_before set,
                        bit 2 retention set, bit 3 cleanup "compact" (else "delete");
                        bits 4-7 zero
    9      1    zero    reserved
    10     2    u16     n: length of the topic name in bytes (UTF-8)
    12     4    u32     queue count (0 unless bit 0)
    16     8    u64     deleted_before: log position of the topic's latest deletion
                        (0 unless bit 1)
    24     8    f64     retention in seconds (0 unless bit 2)
    32     8    f64     delete_retention in seconds
    40     n    bytes   topic name

A record without a queue count is a deleted topic not created again: its policy
fields are zero and mean nothing (topics.json holds only ``deleted_before`` then).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Final

import xxhash

from equeue.errors import (
    ChecksumMismatchError,
    CorruptionError,
    NewerFormatError,
    TruncatedError,
)

TOPICS_JOURNAL_FILE: Final = "topics.journal"
MAGIC: Final = b"EQTOPJ01"
VERSION: Final = 2

_HEADER = struct.Struct("<8sIQI")
_HEADER_V1 = struct.Struct("<8sII")
_RECORD = struct.Struct("<IIBxHIQdd")
HEADER_SIZE: Final = _HEADER.size
RECORD_HEAD_SIZE: Final = _RECORD.size
assert HEADER_SIZE == 24
assert RECORD_HEAD_SIZE == 40

HAS_COUNT: Final = 1
HAS_DELETED: Final = 2
HAS_RETENTION: Final = 4
COMPACT: Final = 8
_FLAGS: Final = HAS_COUNT | HAS_DELETED | HAS_RETENTION | COMPACT


def pack_header(generation: int = 0) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, generation, 0)[:20]
    return head + struct.pack("<I", xxhash.xxh32_intdigest(head))


def check_header(raw: bytes, file: str) -> tuple[int, int]:
    """The journal's generation and where its records start; CorruptionError (naming
    ``file``, offset 0) unless ``raw`` starts with a whole header."""
    version = _HEADER_V1.unpack_from(raw)[1] if len(raw) >= _HEADER_V1.size else VERSION
    size = _HEADER_V1.size if version == 1 else HEADER_SIZE
    if len(raw) < size:
        raise TruncatedError(
            f"a topics journal of {len(raw)} bytes is shorter than its header ({size} bytes)",
            file=file,
            offset=0,
            expected=size,
            found=len(raw),
        )
    if version == 1:
        (magic, version, checksum), generation = _HEADER_V1.unpack_from(raw), 0
    else:
        magic, version, generation, checksum = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptionError(
            "not a topics journal (bad magic)", file=file, offset=0, expected=MAGIC, found=magic
        )
    computed = xxhash.xxh32_intdigest(raw[: size - 4])
    if checksum != computed:
        raise ChecksumMismatchError(
            "topics journal header checksum mismatch",
            file=file,
            offset=0,
            expected=checksum,
            found=computed,
        )
    reads = f"versions 1 and {VERSION}"  # (its checksum holds: no damage, a newer equeue's)
    NewerFormatError.check(
        "topics journal format version", version, VERSION, file=file, offset=8, reads=reads
    )
    if version not in (1, VERSION):
        raise CorruptionError(
            f"topics journal format version {version}; this equeue reads 1 and {VERSION}",
            file=file,
            offset=8,
            expected=VERSION,
            found=version,
        )
    return generation, size


@dataclass(frozen=True, slots=True)
class TopicRecord:
    """One topic's whole topics.json entry (the name is checked by the reader, as the
    API checks it: equeue/store/topicsfile.py)."""

    topic: str
    queue_count: int | None
    deleted_before: int | None = None
    compact: bool = False
    retention_seconds: float | None = None
    delete_retention_seconds: float = 0.0

    def pack(self) -> bytes:
        name = self.topic.encode()
        flags = (
            (HAS_COUNT if self.queue_count is not None else 0)
            | (HAS_DELETED if self.deleted_before is not None else 0)
            | (HAS_RETENTION if self.retention_seconds is not None else 0)
            | (COMPACT if self.compact else 0)
        )
        size = RECORD_HEAD_SIZE + len(name)
        body = (
            _RECORD.pack(
                0,
                size,
                flags,
                len(name),
                self.queue_count or 0,
                self.deleted_before or 0,
                self.retention_seconds or 0.0,
                self.delete_retention_seconds,
            )[4:]
            + name
        )
        return struct.pack("<I", xxhash.xxh32_intdigest(body)) + body

    @classmethod
    def unpack(cls, buf: bytes, at: int, file: str) -> tuple[TopicRecord, int]:
        """The record at ``at`` of ``buf`` and where the next one starts. TruncatedError if
        the buffer ends inside it (a torn append); ChecksumMismatchError or
        CorruptionError (naming ``file`` and ``at``) if it does not check out."""
        available = len(buf) - at
        if available < RECORD_HEAD_SIZE:
            raise TruncatedError(
                f"{available} bytes at the journal's end, less than a record head",
                file=file,
                offset=at,
            )
        checksum, size, flags, n, count, deleted, retention, delete_retention = _RECORD.unpack_from(
            buf, at
        )
        if size != RECORD_HEAD_SIZE + n:
            raise CorruptionError(
                f"record size {size} does not match its name's length {n}", file=file, offset=at
            )
        if available < size:
            raise TruncatedError(
                f"a record of {size} bytes, {available} bytes left", file=file, offset=at
            )
        computed = xxhash.xxh32_intdigest(buf[at + 4 : at + size])
        if checksum != computed:
            raise ChecksumMismatchError(
                "topics journal record checksum mismatch",
                file=file,
                offset=at,
                expected=checksum,
                found=computed,
            )
        if flags & ~_FLAGS or buf[at + 9] != 0:
            raise CorruptionError(f"unknown record flags 0x{flags:02x}", file=file, offset=at)
        try:
            topic = bytes(buf[at + RECORD_HEAD_SIZE : at + size]).decode()
        except UnicodeDecodeError as exc:
            raise CorruptionError(
                f"topic name is not UTF-8 ({exc.reason})", file=file, offset=at
            ) from None
        for name, value in (("retention", retention), ("delete_retention", delete_retention)):
            if not math.isfinite(value) or value < 0:
                raise CorruptionError(f"{name} of {value} seconds", file=file, offset=at)
        record = cls(
            topic,
            count if flags & HAS_COUNT else None,
            deleted if flags & HAS_DELETED else None,
            bool(flags & COMPACT),
            retention if flags & HAS_RETENTION else None,
            delete_retention,
        )
        return record, at + size

    def to_entry(self) -> dict[str, Any]:
        """The record as a topics.json entry (equeue/store/topics.py: ``topics_body``)."""
        entry: dict[str, Any] = {}
        if self.queue_count is not None:
            entry = {
                "queue_count": self.queue_count,
                "cleanup": "compact" if self.compact else "delete",
                "retention_seconds": self.retention_seconds,
                "delete_retention_seconds": self.delete_retention_seconds,
            }
        if self.deleted_before is not None:
            entry["deleted_before"] = self.deleted_before
        return entry

    @classmethod
    def from_entry(cls, topic: str, entry: dict[str, Any]) -> TopicRecord:
        """A topics.json entry as ``topics_body`` writes it."""
        count = entry.get("queue_count")
        retention = entry.get("retention_seconds")
        return cls(
            topic,
            count,
            entry.get("deleted_before"),
            entry.get("cleanup") == "compact",
            None if retention is None else float(retention),
            float(entry.get("delete_retention_seconds", 0.0)) if count is not None else 0.0,
        )
