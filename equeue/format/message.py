"""Layouts of the message log record, the queue log record and message ids.

MessageLogRecord: the payload of one variable-size record in a message chunk
(framing is in ``equeue.format.chunk``). All integers little-endian::

    offset size type    field
    0      8    i64     log position: the record's own global position (checked on read)
    8      8    i64     stored time, ns since the epoch (the chunk's timestamp_offset = 8)
    16     8    i64     created time, ns since the epoch
    24     8    i64     queue offset
    32     4    i32     queue id
    36     4    i32     code
    40     4    u32     tag hash (xxh32 of the UTF-8 tag; 0 for no tag)
    44     1    u8      flags: bit 0 the message has a key
    45     1    u8      topic length (bytes)
    46     1    u8      tag length
    47     1    u8      key length
    48     4    u32     properties length
    52     4    u32     body length
    56     ...          topic, tag, key, properties, body (UTF-8 for the strings)

Properties are encoded as repeated ``u16 key length, key, u16 value length, value``.

QueueLogRecord: one 12-byte slot of a queue chunk (fixed-size records)::

    offset size type    field
    0      8    i64     message position + 1 (so an all-zero slot means "empty")
    8      4    u32     tag hash

Queue offset q lives at queue position q * 12.

Message id: 24 hex digits, the store id (8) then the message position (16),
so ``get(message_id)`` needs no index.
"""

from __future__ import annotations

import re
import struct
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final

import xxhash

from equeue.errors import CorruptionError, TruncatedError

MESSAGE_HEAD: Final = struct.Struct("<qqqqiiIBBBBII")
MESSAGE_HEAD_SIZE: Final = MESSAGE_HEAD.size
assert MESSAGE_HEAD_SIZE == 56
STORED_TIME_OFFSET: Final = 8
RECORD_POSITION: Final = struct.Struct("<q")  # the head's first field: the record's position
TAG_HASH: Final = struct.Struct("<I")  # the head's tag hash, read alone by pulls
TAG_HASH_OFFSET: Final = 40
assert MESSAGE_HEAD.unpack(bytes(40) + b"\x01\x02\x03\x04" + bytes(12))[6] == 0x04030201
# Where the fields sit in the head, for readers that take them column-wise from many
# heads at once (compaction's scan, with numpy).
POSITION_OFFSET: Final = 0
FLAGS_OFFSET: Final = 44
TOPIC_LENGTH_OFFSET: Final = 45  # then the tag length and the key length, a byte each
BODY_LENGTH_OFFSET: Final = 52
assert [struct.calcsize(MESSAGE_HEAD.format[:n]) for n in (1, 8, 9, 13)] == [
    POSITION_OFFSET,
    FLAGS_OFFSET,
    TOPIC_LENGTH_OFFSET,
    BODY_LENGTH_OFFSET,
]
FLAG_HAS_KEY: Final = 1
MAX_NAME_BYTES: Final = 255  # topic, tag and key lengths are u8 fields of the head

QUEUE_RECORD: Final = struct.Struct("<qI")
QUEUE_RECORD_SIZE: Final = QUEUE_RECORD.size
assert QUEUE_RECORD_SIZE == 12

_PROPERTY_LENGTH: Final = struct.Struct("<H")
MESSAGE_ID_LENGTH: Final = 24
_MESSAGE_ID_RE: Final = re.compile(r"[0-9a-fA-F]{24}\Z")


@lru_cache(maxsize=4096)
def tag_hash(tag: str) -> int:
    return xxhash.xxh32_intdigest(tag.encode()) if tag else 0


def encode_properties(properties: dict[str, str]) -> bytes:
    parts: list[bytes] = []
    pack = _PROPERTY_LENGTH.pack
    for key, value in properties.items():
        k, v = key.encode(), value.encode()
        parts += (pack(len(k)), k, pack(len(v)), v)
    return b"".join(parts)


def decode_properties(data: bytes | memoryview) -> dict[str, str]:
    result: dict[str, str] = {}
    pos, end = 0, len(data)
    unpack = _PROPERTY_LENGTH.unpack_from
    try:
        while pos < end:
            (klen,) = unpack(data, pos)
            key = bytes(data[pos + 2 : pos + 2 + klen]).decode()
            pos += 2 + klen
            (vlen,) = unpack(data, pos)
            result[key] = bytes(data[pos + 2 : pos + 2 + vlen]).decode()
            pos += 2 + vlen
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptionError(f"undecodable message properties at byte {pos}: {exc}") from exc
    if pos != end:
        raise CorruptionError(f"message properties overrun their length {end} (reached {pos})")
    return result


def message_id_prefix(store_id: int) -> str:
    """A message id's first 8 hex digits, its store's id; the position's 16 follow.
    Interned: one str per store id, so that the broker's pull packer finds its messages'
    prefix (the store's) the very object it is given (the handlers'), an identity test
    a message rather than a string comparison (perfgroup)."""
    return sys.intern(f"{store_id:08x}")


def encode_message_id(store_id: int, position: int) -> str:
    return f"{store_id:08x}{position:016x}"


def decode_message_id(message_id: str) -> tuple[int, int] | None:
    """(store id, position), or None if the string is not a message id."""
    # int(x, 16) alone would accept signs, "0x", "_" and non-ASCII digits.
    if not isinstance(message_id, str) or not _MESSAGE_ID_RE.match(message_id):
        return None
    return int(message_id[:8], 16), int(message_id[8:], 16)


@dataclass(frozen=True, slots=True)
class MessageLogRecord:
    log_position: int
    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    stored_ns: int
    created_ns: int
    tag: str = ""
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    code: int = 0

    def pack(self) -> bytes:
        topic, tag = self.topic.encode(), self.tag.encode()
        key = self.key.encode() if self.key is not None else b""
        props = encode_properties(self.properties) if self.properties else b""
        return pack_message(
            self.log_position,
            self.stored_ns,
            self.created_ns,
            self.queue_offset,
            self.queue_id,
            self.code,
            tag_hash(self.tag),
            FLAG_HAS_KEY if self.key is not None else 0,
            topic,
            tag,
            key,
            props,
            self.body,
        )

    @classmethod
    def unpack(
        cls, data: bytes, *, file: str | None = None, offset: int | None = None
    ) -> MessageLogRecord:
        if len(data) < MESSAGE_HEAD_SIZE:
            raise TruncatedError(
                f"message record of {len(data)} bytes is shorter than its {MESSAGE_HEAD_SIZE}-byte"
                " head",
                file=file,
                offset=offset,
            )
        (pos, stored, created, qoff, qid, code, _th, flags, tl, gl, kl, pl, bl) = (
            MESSAGE_HEAD.unpack_from(data)
        )
        if MESSAGE_HEAD_SIZE + tl + gl + kl + pl + bl != len(data):
            raise CorruptionError(
                "message record lengths do not add up to the record size",
                file=file,
                offset=offset,
                expected=len(data),
                found=MESSAGE_HEAD_SIZE + tl + gl + kl + pl + bl,
            )
        p = MESSAGE_HEAD_SIZE
        try:
            topic = data[p : p + tl].decode()
            tag = data[p + tl : p + tl + gl].decode()
            p += tl + gl
            key = data[p : p + kl].decode() if flags & FLAG_HAS_KEY else None
        except UnicodeDecodeError as exc:
            raise CorruptionError(
                f"undecodable message string: {exc}", file=file, offset=offset
            ) from exc
        p += kl
        props = decode_properties(data[p : p + pl]) if pl else {}
        return cls(
            log_position=pos,
            topic=topic,
            queue_id=qid,
            queue_offset=qoff,
            body=data[p + pl :],
            stored_ns=stored,
            created_ns=created,
            tag=tag,
            key=key,
            properties=props,
            code=code,
        )


def pack_message(
    position: int,
    stored_ns: int,
    created_ns: int,
    queue_offset: int,
    queue_id: int,
    code: int,
    tag_hash_value: int,
    flags: int,
    topic: bytes,
    tag: bytes,
    key: bytes,
    properties: bytes,
    body: bytes,
) -> bytes:
    """The hot-path encoder: the caller has already encoded and checked every field."""
    head = MESSAGE_HEAD.pack(
        position,
        stored_ns,
        created_ns,
        queue_offset,
        queue_id,
        code,
        tag_hash_value,
        flags,
        len(topic),
        len(tag),
        len(key),
        len(properties),
        len(body),
    )
    return b"".join((head, topic, tag, key, properties, body))


def message_length(topic: bytes, tag: bytes, key: bytes, properties: bytes, body: bytes) -> int:
    return MESSAGE_HEAD_SIZE + len(topic) + len(tag) + len(key) + len(properties) + len(body)


@dataclass(frozen=True, slots=True)
class QueueLogRecord:
    message_position: int
    tag_hash: int

    def pack(self) -> bytes:
        return QUEUE_RECORD.pack(self.message_position + 1, self.tag_hash)

    @classmethod
    def unpack(cls, data: bytes) -> QueueLogRecord | None:
        """None for an empty (all-zero) slot."""
        if len(data) < QUEUE_RECORD_SIZE:
            raise TruncatedError(f"queue record of {len(data)} bytes, expected 12")
        stored, th = QUEUE_RECORD.unpack_from(data)
        if stored <= 0:
            return None
        return cls(stored - 1, th)
