"""On-disk layout of ``tail.live``: where the ongoing log chunk's records ended,
as the writer last noted it, trusted only within the boot that wrote it.

The checkpoint (``checkpoint.json``) only names positions an fdatasync covered,
so after a crash recovery walks, checksum by checksum, everything written
since: tens of MiB behind a fast writer. A process that dies without the
machine going down leaves every byte it wrote in the OS page cache, where the
next process reads it exactly as written. So the writer also notes, every half
prefault window of the log (256 KiB), a point before which every record and its
queue entries are in place and every key is committed to the key index;
recovery in the same boot starts there. A power loss or kernel crash changes
the boot id, and the file is then ignored: nothing in it is ever flushed or
relied on across a reboot.

File (little-endian, 192 bytes, rewritten at each writable open)::

    offset size type    field
    0      8    bytes   magic b"EQLIVE01"
    8      16   bytes   boot id (Linux: /proc/sys/kernel/random/boot_id) of the writer
    24     40   zero    reserved
    64     64   slot    slot 0
    128    64   slot    slot 1

Slot (the writer alternates between the two, so a write torn by a kill leaves
the other one whole)::

    offset size type    field
    0      8    u64     sequence number (0: the slot is empty)
    8      16   bytes   chunk id of the ongoing log chunk
    24     8    u64     data end: records of that chunk end at this data offset
    32     8    u64     record count: how many records end there
    40     8    zero    reserved
    48     8    u64     xxh64 of bytes 0..47 of the slot
    56     8    zero    reserved
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import Final

import xxhash

LIVE_TAIL_FILE: Final = "tail.live"
MAGIC: Final = b"EQLIVE01"

_HEADER = struct.Struct("<8s16s40x")
_SLOT = struct.Struct("<Q16sQQ8xQ8x")
HEADER_SIZE: Final = _HEADER.size
SLOT_SIZE: Final = _SLOT.size
assert HEADER_SIZE == 64
assert SLOT_SIZE == 64
SLOT_OFFSETS: Final = (HEADER_SIZE, HEADER_SIZE + SLOT_SIZE)
FILE_SIZE: Final = HEADER_SIZE + 2 * SLOT_SIZE
_CHECKED: Final = SLOT_SIZE - 16  # the checksum covers the fields before it


@dataclass(frozen=True, slots=True)
class LiveTailHeader:
    boot_id: uuid.UUID

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.boot_id.bytes)

    @classmethod
    def unpack(cls, raw: bytes) -> LiveTailHeader | None:
        """None for anything but a whole header with the magic."""
        if len(raw) < HEADER_SIZE:
            return None
        magic, boot = _HEADER.unpack_from(raw)
        return cls(uuid.UUID(bytes=boot)) if magic == MAGIC else None


@dataclass(frozen=True, slots=True)
class LiveTail:
    sequence: int
    chunk_id: uuid.UUID
    data_end: int
    record_count: int

    def pack(self) -> bytes:
        fields = (self.sequence, self.chunk_id.bytes, self.data_end, self.record_count)
        checksum = xxhash.xxh64_intdigest(_SLOT.pack(*fields, 0)[:_CHECKED])
        return _SLOT.pack(*fields, checksum)

    @classmethod
    def unpack(cls, raw: bytes) -> LiveTail | None:
        """None for an empty slot, a short one or one whose checksum does not match (a
        write torn by a kill): the caller falls back to the other slot or the checkpoint."""
        if len(raw) < SLOT_SIZE:
            return None
        sequence, chunk_id, data_end, records, checksum = _SLOT.unpack_from(raw)
        if sequence == 0 or checksum != xxhash.xxh64_intdigest(raw[:_CHECKED]):
            return None
        return cls(sequence, uuid.UUID(bytes=chunk_id), data_end, records)


def newest(raw: bytes, boot_id: uuid.UUID) -> LiveTail | None:
    """The newest whole slot of a ``tail.live`` written in boot ``boot_id``, else None."""
    header = LiveTailHeader.unpack(raw)
    if header is None or header.boot_id != boot_id:
        return None
    slots = [LiveTail.unpack(raw[at : at + SLOT_SIZE]) for at in SLOT_OFFSETS]
    whole = [slot for slot in slots if slot is not None]
    return max(whole, key=lambda slot: slot.sequence) if whole else None
