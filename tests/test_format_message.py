"""The message log record, the queue log record, message ids, tag hashes and properties."""

from __future__ import annotations

import contextlib
import struct

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from equeue.errors import CorruptionError, TruncatedError
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    MESSAGE_ID_LENGTH,
    QUEUE_RECORD,
    QUEUE_RECORD_SIZE,
    STORED_TIME_OFFSET,
    MessageLogRecord,
    QueueLogRecord,
    decode_message_id,
    decode_properties,
    encode_message_id,
    encode_properties,
    message_length,
    tag_hash,
)

I32 = st.integers(-(1 << 31), (1 << 31) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
NON_NEGATIVE_I64 = st.integers(0, (1 << 63) - 1)
U32 = st.integers(0, (1 << 32) - 1)

# Any Unicode text UTF-8 can encode (no lone surrogates).
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
NAME = TEXT.filter(lambda s: len(s.encode()) <= 255)
TOPIC = st.text(
    st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-"),
    min_size=1,
    max_size=255,
)
PROPERTIES = st.dictionaries(TEXT, TEXT, max_size=6)


@st.composite
def records(draw: st.DrawFn) -> MessageLogRecord:
    return MessageLogRecord(
        log_position=draw(NON_NEGATIVE_I64),
        topic=draw(TOPIC),
        queue_id=draw(st.integers(0, (1 << 31) - 1)),
        queue_offset=draw(NON_NEGATIVE_I64),
        body=draw(st.binary(max_size=300)),
        stored_ns=draw(I64),
        created_ns=draw(I64),
        tag=draw(NAME),
        key=draw(st.none() | NAME),
        properties=draw(PROPERTIES),
        code=draw(I32),
    )


# --- MessageLogRecord ----------------------------------------------------------


@given(records())
def test_message_record_round_trip(record: MessageLogRecord) -> None:
    packed = record.pack()
    assert isinstance(packed, bytes)
    unpacked = MessageLogRecord.unpack(packed)
    assert unpacked == record
    assert type(unpacked.body) is bytes
    assert unpacked.key == record.key  # None and "" are different keys


@given(records())
def test_message_record_layout(record: MessageLogRecord) -> None:
    packed = record.pack()
    topic, tag = record.topic.encode(), record.tag.encode()
    key = b"" if record.key is None else record.key.encode()
    props = encode_properties(record.properties)
    assert len(packed) == message_length(topic, tag, key, props, record.body)
    (pos, stored, created, qoff, qid, code, th, flags, tl, gl, kl, pl, bl) = (
        MESSAGE_HEAD.unpack_from(packed)
    )
    assert (pos, stored, created, qoff, qid, code) == (
        record.log_position,
        record.stored_ns,
        record.created_ns,
        record.queue_offset,
        record.queue_id,
        record.code,
    )
    assert th == tag_hash(record.tag)
    assert flags == (FLAG_HAS_KEY if record.key is not None else 0)
    assert (tl, gl, kl, pl, bl) == (len(topic), len(tag), len(key), len(props), len(record.body))
    # The chunk layer reads the stored time at a fixed offset.
    assert struct.unpack_from("<q", packed, STORED_TIME_OFFSET)[0] == record.stored_ns
    assert packed[MESSAGE_HEAD_SIZE:] == topic + tag + key + props + record.body


def test_message_record_empty_key_differs_from_no_key() -> None:
    base = MessageLogRecord(0, "t", 0, 0, b"b", 1, 2)
    with_empty_key = MessageLogRecord(0, "t", 0, 0, b"b", 1, 2, key="")
    assert MessageLogRecord.unpack(base.pack()).key is None
    assert MessageLogRecord.unpack(with_empty_key.pack()).key == ""
    assert base.pack() != with_empty_key.pack()


def _sample_record() -> MessageLogRecord:
    return MessageLogRecord(
        log_position=4096,
        topic="orders",
        queue_id=3,
        queue_offset=17,
        body=b"\x00payload\xff" * 3,
        stored_ns=1_700_000_000_000_000_001,
        created_ns=1_700_000_000_000_000_000,
        tag="TagA",
        key="k-\u00e9",
        properties={"a": "1", "\u00fc": "\u20ac"},
        code=-5,
    )


@pytest.mark.parametrize("length", list(range(0, MESSAGE_HEAD_SIZE)))
def test_message_record_shorter_than_head_is_truncated(length: int) -> None:
    packed = _sample_record().pack()
    with pytest.raises(TruncatedError):
        MessageLogRecord.unpack(packed[:length], file="f", offset=7)


def test_message_record_every_truncation_raises_corruption() -> None:
    packed = _sample_record().pack()
    for length in range(len(packed)):
        with pytest.raises(CorruptionError):
            MessageLogRecord.unpack(packed[:length])


def test_message_record_extra_bytes_raise_corruption() -> None:
    packed = _sample_record().pack()
    with pytest.raises(CorruptionError, match="do not add up"):
        MessageLogRecord.unpack(packed + b"\x00")


def test_message_record_error_names_file_and_offset() -> None:
    with pytest.raises(CorruptionError) as info:
        MessageLogRecord.unpack(b"\x01" * 10, file="/x/chunk-0", offset=300)
    assert info.value.file == "/x/chunk-0"
    assert info.value.offset == 300
    assert "/x/chunk-0" in str(info.value) and "300" in str(info.value)


def test_message_record_invalid_utf8_raises_corruption() -> None:
    packed = bytearray(_sample_record().pack())
    packed[MESSAGE_HEAD_SIZE] = 0xFF  # first byte of the topic
    with pytest.raises(CorruptionError):
        MessageLogRecord.unpack(bytes(packed))


def test_message_record_garbled_properties_raise_corruption() -> None:
    record = _sample_record()
    packed = bytearray(record.pack())
    props_at = MESSAGE_HEAD_SIZE + len(b"orders") + len(b"TagA") + len("k-\u00e9".encode())
    packed[props_at] = 0xFE  # the first property key length now overruns the properties
    with pytest.raises(CorruptionError):
        MessageLogRecord.unpack(bytes(packed))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(records(), st.data())
def test_message_record_garbled_bytes_never_leak_other_errors(
    record: MessageLogRecord, data: st.DataObject
) -> None:
    packed = bytearray(record.pack())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(packed) - 1))
        packed[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(packed)))
    with contextlib.suppress(CorruptionError):
        MessageLogRecord.unpack(bytes(packed[:cut]))


@given(st.binary(max_size=400))
def test_message_record_arbitrary_bytes_never_leak_other_errors(raw: bytes) -> None:
    with contextlib.suppress(CorruptionError):
        MessageLogRecord.unpack(raw)


@given(records(), st.data())
def test_message_record_lengths_reshuffled(record: MessageLogRecord, data: st.DataObject) -> None:
    """Length fields rewritten so that they still add up: a record or CorruptionError."""
    packed = bytearray(record.pack())
    head = list(MESSAGE_HEAD.unpack_from(packed))
    total = sum(head[8:13])
    tl = data.draw(st.integers(0, min(255, total)))
    gl = data.draw(st.integers(0, min(255, total - tl)))
    kl = data.draw(st.integers(0, min(255, total - tl - gl)))
    pl = data.draw(st.integers(0, total - tl - gl - kl))
    head[7] = data.draw(st.integers(0, 255))  # flags
    head[8:13] = [tl, gl, kl, pl, total - tl - gl - kl - pl]
    MESSAGE_HEAD.pack_into(packed, 0, *head)
    with contextlib.suppress(CorruptionError):
        MessageLogRecord.unpack(bytes(packed))


# --- QueueLogRecord --------------------------------------------------------------


@given(NON_NEGATIVE_I64.filter(lambda p: p < (1 << 63) - 1), U32)
def test_queue_record_round_trip(position: int, hashed: int) -> None:
    record = QueueLogRecord(position, hashed)
    packed = record.pack()
    assert len(packed) == QUEUE_RECORD_SIZE == 12
    assert QueueLogRecord.unpack(packed) == record
    # Stored as position + 1, so position 0 is not an empty slot.
    assert QUEUE_RECORD.unpack(packed) == (position + 1, hashed)
    assert packed != bytes(12)


def test_queue_record_position_zero_is_not_empty() -> None:
    packed = QueueLogRecord(0, 0).pack()
    assert packed == struct.pack("<qI", 1, 0)
    assert QueueLogRecord.unpack(packed) == QueueLogRecord(0, 0)


def test_queue_record_all_zero_slot_is_empty() -> None:
    assert QueueLogRecord.unpack(bytes(12)) is None
    assert QueueLogRecord.unpack(bytes(24)) is None  # only the first 12 bytes count


@pytest.mark.parametrize("length", list(range(12)))
def test_queue_record_truncated(length: int) -> None:
    with pytest.raises(TruncatedError):
        QueueLogRecord.unpack(QueueLogRecord(5, 6).pack()[:length])


# --- message ids -----------------------------------------------------------------


@given(U32, st.integers(0, (1 << 64) - 1))
def test_message_id_round_trip(store_id: int, position: int) -> None:
    message_id = encode_message_id(store_id, position)
    assert len(message_id) == MESSAGE_ID_LENGTH == 24
    assert all(c in "0123456789abcdef" for c in message_id)
    assert message_id[:8] == f"{store_id:08x}"
    assert decode_message_id(message_id) == (store_id, position)


@pytest.mark.parametrize(
    "message_id",
    [
        "",
        "0" * 23,
        "0" * 25,
        "g" * 24,
        "0000000z0000000000000000",
        "00000000000000000000000\u00e9",
        None,
        b"000000000000000000000000",
        123,
    ],
)
def test_message_id_garbage_decodes_to_none(message_id: object) -> None:
    assert decode_message_id(message_id) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message_id",
    [
        "12345678-000000000000001",
        "12345678+000000000000001",
        "12345678 000000000000001",
        "123456780x00000000000001",
        "12345678000000000000_001",
        "-2345678" + "0" * 16,
        "12345678" + "\uff10" * 16,  # fullwidth digits
    ],
)
def test_message_id_non_canonical_forms_decode_to_none(message_id: str) -> None:
    assert len(message_id) == 24
    assert decode_message_id(message_id) is None


# --- tag hash ----------------------------------------------------------------------


def test_tag_hash_of_no_tag_is_zero() -> None:
    assert tag_hash("") == 0


@given(NAME.filter(bool))
def test_tag_hash_is_xxh32_of_utf8(tag: str) -> None:
    assert tag_hash(tag) == xxhash.xxh32_intdigest(tag.encode())
    assert 0 <= tag_hash(tag) < 1 << 32


def test_tag_hash_distinguishes_simple_tags() -> None:
    assert len({tag_hash(t) for t in ("a", "b", "TagA", "TagB", "\u00e9")}) == 5


# --- properties ----------------------------------------------------------------------


@given(PROPERTIES)
def test_properties_round_trip(properties: dict[str, str]) -> None:
    encoded = encode_properties(properties)
    assert decode_properties(encoded) == properties
    assert decode_properties(memoryview(encoded)) == properties
    assert list(decode_properties(encoded)) == list(properties)  # order kept


def test_properties_layout() -> None:
    encoded = encode_properties({"ab": "\u20ac", "": ""})
    assert encoded == b"\x02\x00ab\x03\x00\xe2\x82\xac" + b"\x00\x00" + b"\x00\x00"
    assert encode_properties({}) == b""
    assert decode_properties(b"") == {}


@pytest.mark.parametrize(
    "raw",
    [
        b"\x01",  # half a key length
        b"\x05\x00ab",  # key runs past the end
        b"\x01\x00a",  # no value length
        b"\x01\x00a\x01",  # half a value length
        b"\x01\x00a\x04\x00xy",  # value runs past the end
        b"\x01\x00\xff\x00\x00",  # key is not UTF-8
        b"\x01\x00a\x01\x00\xc3",  # value is not UTF-8 (a cut sequence)
    ],
)
def test_properties_garbled_raise_corruption(raw: bytes) -> None:
    with pytest.raises(CorruptionError):
        decode_properties(raw)


@given(st.binary(max_size=64))
def test_properties_arbitrary_bytes_never_leak_other_errors(raw: bytes) -> None:
    try:
        result = decode_properties(raw)
    except CorruptionError:
        return
    # Re-encoding gives the same bytes, or fewer when a key repeated (the last one wins).
    again = encode_properties(result)
    assert again == raw or len(again) < len(raw)
