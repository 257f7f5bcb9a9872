"""equeue.format.chunk: header, footer, position map, frames and file names."""

from __future__ import annotations

import contextlib
import struct
import uuid

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from equeue.errors import (
    ChecksumMismatchError,
    CorruptionError,
    NewerFormatError,
    TruncatedError,
)
from equeue.format.chunk import (
    FOOTER_MAGIC,
    FOOTER_SIZE,
    FORMAT_VERSION,
    FRAME_OVERHEAD,
    FRAME_PREFIX_SIZE,
    HEADER_MAGIC,
    HEADER_SIZE,
    INT64_MIN,
    MAP_ENTRY_SIZE,
    MAX_CHUNK_DATA_SIZE,
    MIN_CHUNK_DATA_SIZE,
    TEMP_SUFFIX,
    ChunkFooter,
    ChunkHeader,
    ChunkType,
    PositionMapEntry,
    chunk_file_name,
    chunk_file_size,
    frame_packer,
    frame_problem,
    parse_chunk_file_name,
    record_checksum,
)

U64 = st.integers(0, (1 << 64) - 1)
U32 = st.integers(0, (1 << 32) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
TIMESTAMPS = st.none() | st.integers(INT64_MIN + 1, (1 << 63) - 1)  # INT64_MIN means "none"

FILE = "/data/chunk-000000000007.0000"


@st.composite
def headers(draw: st.DrawFn) -> ChunkHeader:
    start = draw(U64)
    return ChunkHeader(
        chunk_type=draw(st.sampled_from(ChunkType)),
        chunk_start_number=start,
        chunk_end_number=draw(st.integers(start, (1 << 64) - 1)),
        chunk_data_size=draw(U64),
        chunk_id=draw(st.uuids()),
        record_size=draw(U32),
        compacted=draw(st.booleans()),
        timestamp_offset=draw(st.none() | U32),
        created_at_ns=draw(I64),
    )


@st.composite
def footers(draw: st.DrawFn) -> ChunkFooter:
    return ChunkFooter(
        completed=draw(st.booleans()),
        physical_data_size=draw(U64),
        logical_data_size=draw(U64),
        map_entry_count=draw(U64),
        record_count=draw(U64),
        first_timestamp=draw(TIMESTAMPS),
        last_timestamp=draw(TIMESTAMPS),
        checksum=draw(U64),
    )


def sample_header(**changes: int) -> ChunkHeader:
    fields: dict[str, int] = {"chunk_start_number": 7, "chunk_end_number": 7, **changes}
    return ChunkHeader(
        chunk_type=ChunkType.VARIABLE,
        chunk_start_number=fields["chunk_start_number"],
        chunk_end_number=fields["chunk_end_number"],
        chunk_data_size=4096,
        chunk_id=uuid.UUID(int=0x1234),
        timestamp_offset=8,
        created_at_ns=1_700_000_000_000_000_000,
    )


def sample_footer() -> ChunkFooter:
    return ChunkFooter(
        completed=True,
        physical_data_size=4000,
        logical_data_size=4000,
        map_entry_count=0,
        record_count=17,
        first_timestamp=None,
        last_timestamp=-5,
        checksum=0xDEADBEEF_01234567,
    )


def reseal(raw: bytes) -> bytes:
    """Recompute the self-checksum of a header or footer after editing its body."""
    return raw[:124] + xxhash.xxh32_intdigest(raw[:124]).to_bytes(4, "little")


def assert_where(exc: CorruptionError, offset: int) -> None:
    assert exc.file == FILE
    assert exc.offset == offset
    assert FILE in str(exc)
    assert f"at offset {offset} (0x{offset:x})" in str(exc)


# --- sizes -------------------------------------------------------------------


def test_size_constants() -> None:
    assert HEADER_SIZE == 128
    assert FOOTER_SIZE == 128
    assert FRAME_PREFIX_SIZE == 4
    assert FRAME_OVERHEAD == 12
    assert MAP_ENTRY_SIZE == 12
    assert MIN_CHUNK_DATA_SIZE == 4096
    assert MAX_CHUNK_DATA_SIZE == 1 << 31
    assert FORMAT_VERSION == 1
    assert chunk_file_size(4096) == 128 + 4096 + 128
    assert len(sample_header().pack()) == HEADER_SIZE
    assert len(sample_footer().pack()) == FOOTER_SIZE
    assert len(PositionMapEntry(1, 2).pack()) == MAP_ENTRY_SIZE


def test_header_byte_layout_matches_the_table() -> None:
    header = ChunkHeader(
        chunk_type=ChunkType.FIXED,
        chunk_start_number=3,
        chunk_end_number=5,
        chunk_data_size=8192,
        chunk_id=uuid.UUID(int=0xABCDEF),
        record_size=16,
        compacted=True,
        timestamp_offset=4,
        created_at_ns=-2,
    )
    raw = header.pack()
    assert raw[0:4] == HEADER_MAGIC
    assert struct.unpack_from("<H", raw, 4) == (1,)
    assert raw[6] == 1  # fixed
    assert raw[7] == 0b11  # compacted + timestamps
    assert struct.unpack_from("<IIQQQ", raw, 8) == (16, 4, 3, 5, 8192)
    assert raw[40:56] == uuid.UUID(int=0xABCDEF).bytes
    assert struct.unpack_from("<q", raw, 56) == (-2,)
    assert raw[64:124] == bytes(60)
    assert int.from_bytes(raw[124:128], "little") == xxhash.xxh32_intdigest(raw[:124])
    assert header.start_position == 3 * 8192
    assert header.end_position == 6 * 8192


def test_footer_byte_layout_matches_the_table() -> None:
    raw = sample_footer().pack()
    assert raw[0:4] == FOOTER_MAGIC
    assert raw[4] == 1
    assert raw[5:8] == bytes(3)
    assert struct.unpack_from("<QQQQqqQ", raw, 8) == (
        4000,
        4000,
        0,
        17,
        INT64_MIN,
        -5,
        0xDEADBEEF_01234567,
    )
    assert raw[64:124] == bytes(60)
    assert int.from_bytes(raw[124:128], "little") == xxhash.xxh32_intdigest(raw[:124])


# --- round trips -------------------------------------------------------------


@given(headers())
def test_header_round_trip(header: ChunkHeader) -> None:
    raw = header.pack()
    assert len(raw) == HEADER_SIZE
    assert ChunkHeader.unpack(raw) == header
    assert ChunkHeader.unpack(memoryview(raw + b"trailing bytes")) == header


@given(footers())
def test_footer_round_trip(footer: ChunkFooter) -> None:
    raw = footer.pack()
    assert len(raw) == FOOTER_SIZE
    assert ChunkFooter.unpack(raw) == footer
    assert ChunkFooter.unpack(memoryview(raw + b"x")) == footer
    assert not ChunkFooter.is_blank(raw)


def test_footer_int64_min_timestamp_reads_as_none() -> None:
    footer = ChunkFooter(True, 1, 1, 0, 1, INT64_MIN, INT64_MIN, 0)
    assert ChunkFooter.unpack(footer.pack()).first_timestamp is None
    assert ChunkFooter.unpack(footer.pack()).last_timestamp is None


def test_blank_footer() -> None:
    assert ChunkFooter.is_blank(bytes(FOOTER_SIZE))
    assert not ChunkFooter.is_blank(bytes(FOOTER_SIZE - 1) + b"\x01")


@given(U64, U32)
def test_position_map_entry_round_trip(logical: int, physical: int) -> None:
    entry = PositionMapEntry(logical, physical)
    raw = entry.pack()
    assert raw == struct.pack("<QI", logical, physical)
    assert PositionMapEntry.unpack(raw) == entry
    assert PositionMapEntry.unpack(memoryview(b"\xff" * 4 + raw)[4:]) == entry


# --- short buffers -----------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 4, 64, 123, 124, 127])
def test_short_header_raises_truncated(length: int) -> None:
    raw = sample_header().pack()[:length]
    for buf in (raw, memoryview(raw)):
        with pytest.raises(TruncatedError) as info:
            ChunkHeader.unpack(buf, file=FILE)
        assert_where(info.value, 0)


@pytest.mark.parametrize("length", [0, 3, 64, 127])
def test_short_footer_raises_truncated(length: int) -> None:
    with pytest.raises(TruncatedError) as info:
        ChunkFooter.unpack(sample_footer().pack()[:length], file=FILE, offset=4224)
    assert_where(info.value, 4224)


@pytest.mark.parametrize("length", [0, 8, 11])
def test_short_map_entry_raises_truncated(length: int) -> None:
    with pytest.raises(TruncatedError) as info:
        PositionMapEntry.unpack(PositionMapEntry(1, 2).pack()[:length], file=FILE, offset=300)
    assert_where(info.value, 300)


@given(st.binary(max_size=HEADER_SIZE - 1))
def test_any_short_buffer_raises_truncated_never_struct_error(raw: bytes) -> None:
    for unpack in (ChunkHeader.unpack, ChunkFooter.unpack):
        with pytest.raises(TruncatedError):
            unpack(raw)
    if len(raw) < MAP_ENTRY_SIZE:
        with pytest.raises(TruncatedError):
            PositionMapEntry.unpack(raw)


@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_garbage_raises_corruption_never_struct_error(raw: bytes) -> None:
    # 128 random bytes almost never form a valid header or footer; whatever they
    # are, the only failure allowed is a CorruptionError.
    for unpack in (ChunkHeader.unpack, ChunkFooter.unpack):
        with contextlib.suppress(CorruptionError):
            unpack(raw)


# --- damage ------------------------------------------------------------------


def test_bad_header_magic() -> None:
    raw = b"EQFT" + sample_header().pack()[4:]
    with pytest.raises(CorruptionError) as info:
        ChunkHeader.unpack(raw, file=FILE)
    assert not isinstance(info.value, ChecksumMismatchError)
    assert "magic" in str(info.value)
    assert_where(info.value, 0)


def test_bad_footer_magic() -> None:
    raw = b"EQCH" + sample_footer().pack()[4:]
    with pytest.raises(CorruptionError) as info:
        ChunkFooter.unpack(raw, file=FILE, offset=4224)
    assert "magic" in str(info.value)
    assert_where(info.value, 4224)


@pytest.mark.parametrize("index", [4, 6, 8, 16, 32, 40, 56, 64, 100, 123, 124, 127])
def test_flipped_header_byte_raises_checksum_mismatch(index: int) -> None:
    raw = bytearray(sample_header().pack())
    raw[index] ^= 0x01
    with pytest.raises(ChecksumMismatchError) as info:
        ChunkHeader.unpack(bytes(raw), file=FILE)
    assert_where(info.value, 0)
    assert "checksum" in str(info.value)


@pytest.mark.parametrize("index", [4, 5, 8, 16, 24, 32, 40, 48, 56, 63, 64, 123, 124, 127])
def test_flipped_footer_byte_raises_checksum_mismatch(index: int) -> None:
    raw = bytearray(sample_footer().pack())
    raw[index] ^= 0x80
    with pytest.raises(ChecksumMismatchError) as info:
        ChunkFooter.unpack(bytes(raw), file=FILE, offset=4224)
    assert_where(info.value, 4224)


@given(headers(), st.integers(0, HEADER_SIZE - 1), st.integers(1, 255))
def test_any_damaged_header_byte_is_detected(header: ChunkHeader, index: int, mask: int) -> None:
    raw = bytearray(header.pack())
    raw[index] ^= mask
    with pytest.raises(CorruptionError) as info:
        ChunkHeader.unpack(bytes(raw), file=FILE)
    assert_where(info.value, 0)


@given(footers(), st.integers(0, FOOTER_SIZE - 1), st.integers(1, 255))
def test_any_damaged_footer_byte_is_detected(footer: ChunkFooter, index: int, mask: int) -> None:
    raw = bytearray(footer.pack())
    raw[index] ^= mask
    with pytest.raises(CorruptionError) as info:
        ChunkFooter.unpack(bytes(raw), file=FILE, offset=999)
    assert_where(info.value, 999)


def test_unsupported_version() -> None:
    """Version 0 (no equeue wrote it) is damage; a version above FORMAT_VERSION whose
    header checks out is a newer equeue's: NewerFormatError, no CorruptionError (a queue
    chunk's damage is rebuilt from the log: a newer one must not be)."""
    raw = bytearray(sample_header().pack())
    raw[4:6] = (0).to_bytes(2, "little")
    with pytest.raises(CorruptionError, match="version") as info:
        ChunkHeader.unpack(reseal(bytes(raw)), file=FILE)
    assert_where(info.value, 4)
    raw[4:6] = (2).to_bytes(2, "little")
    with pytest.raises(NewerFormatError, match=r"version 2.*newer equeue") as newer:
        ChunkHeader.unpack(reseal(bytes(raw)), file=FILE)
    assert not isinstance(newer.value, CorruptionError)
    assert (newer.value.file, newer.value.offset, newer.value.found) == (FILE, 4, 2)


def test_unknown_chunk_type() -> None:
    raw = bytearray(sample_header().pack())
    raw[6] = 7
    with pytest.raises(CorruptionError, match="chunk type") as info:
        ChunkHeader.unpack(reseal(bytes(raw)), file=FILE)
    assert_where(info.value, 6)


def test_end_number_below_start_number() -> None:
    raw = sample_header(chunk_start_number=9, chunk_end_number=8).pack()
    with pytest.raises(CorruptionError, match="below start") as info:
        ChunkHeader.unpack(raw, file=FILE)
    assert_where(info.value, 24)


# --- frames ------------------------------------------------------------------


def make_frame(payload: bytes) -> bytes:
    buf = bytearray(len(payload) + FRAME_OVERHEAD)
    frame_packer(len(payload))(
        buf, 0, len(payload), payload, record_checksum(payload), len(payload)
    )
    return bytes(buf)


def test_frame_layout() -> None:
    frame = make_frame(b"hello")
    checksum = xxhash.xxh3_64_intdigest(b"hello") & 0xFFFFFFFF
    assert frame == struct.pack("<I5sII", 5, b"hello", checksum, 5)


@given(st.binary(min_size=1, max_size=300), st.binary(max_size=20), st.binary(max_size=20))
def test_good_frame_has_no_problem(payload: bytes, before: bytes, after: bytes) -> None:
    buf = before + make_frame(payload) + after
    end = len(before) + len(payload) + FRAME_OVERHEAD
    assert frame_problem(buf, len(before), end, len(payload)) is None
    assert frame_problem(memoryview(buf), len(before), len(buf), 1 << 20) is None


@given(st.binary(min_size=1, max_size=300), st.data())
def test_any_damaged_frame_byte_is_a_problem(payload: bytes, data: st.DataObject) -> None:
    frame = bytearray(make_frame(payload))
    index = data.draw(st.integers(0, len(frame) - 1))
    frame[index] ^= data.draw(st.integers(1, 255))
    assert frame_problem(bytes(frame) + bytes(64), 0, len(frame), 1 << 20) is not None


def frame_reason(buf: bytes, end: int | None = None, max_length: int = 1000) -> str:
    problem = frame_problem(buf, 0, len(buf) if end is None else end, max_length)
    assert problem is not None
    return problem[0]


def test_frame_problems_are_named() -> None:
    good = make_frame(b"abcdef")
    assert frame_reason(bytes(32)) == "zero record length"
    assert "does not fit" in frame_reason(good[:12])
    assert "maximum 5" in frame_reason(good, max_length=5)
    assert frame_problem(good, 0, len(good), 6) is None  # the maximum itself is allowed
    assert "past the end" in frame_reason(good + bytes(8), end=len(good) - 1)
    assert "suffix" in frame_reason(good[:-4] + (7).to_bytes(4, "little"))
    assert "checksum" in frame_reason(good[:4] + b"abcdeX" + good[10:])
    bad_checksum = good[:10] + bytes(4) + good[14:]
    problem = frame_problem(bad_checksum, 0, len(good), 1000)
    assert problem is not None
    assert problem[1] == 0  # stored
    assert problem[2] == record_checksum(b"abcdef")  # computed


def test_frame_at_an_offset() -> None:
    buf = make_frame(b"first") + make_frame(b"second")
    second = len(b"first") + FRAME_OVERHEAD
    assert frame_problem(buf, 0, len(buf), 100) is None
    assert frame_problem(buf, second, len(buf), 100) is None
    assert frame_problem(buf, 1, len(buf), 100) is not None


# --- file names --------------------------------------------------------------


def test_chunk_file_name_format() -> None:
    assert chunk_file_name(0) == "chunk-000000000000.0000"
    assert chunk_file_name(42, 3) == "chunk-000000000042.0003"
    assert parse_chunk_file_name("chunk-000000000042.0003") == (42, 3)


@given(U64, st.integers(0, 1 << 20))
def test_chunk_file_name_round_trip(number: int, version: int) -> None:
    # Every number a header can hold gets a name that parses back (the format widths
    # are minimums); names sort by number while they have the same width.
    name = chunk_file_name(number, version)
    assert parse_chunk_file_name(name) == (number, version)
    assert parse_chunk_file_name(name + TEMP_SUFFIX) is None
    assert parse_chunk_file_name(f"{name}.0123abcd{TEMP_SUFFIX}") is None


@pytest.mark.parametrize(
    "name",
    [
        "",
        "chunk-00000000004.0000",  # 11 digits
        "chunk-000000000042.000",  # 3 digits
        "chunk-000000000042",
        "chunk-000000000042.0000.tmp",
        "chunk-000000000042.0000.cut",
        "xchunk-000000000042.0000",
        "chunk-00000000004a.0000",
        "chunk--00000000042.0000",
        "recovered",
        # Names only a listing can bring (a name the API makes is ASCII): non-ASCII decimal
        # digits, which \d matched and int() reads, and a final newline, which "$" let by.
        "chunk-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0664\u0662.0000",
        "chunk-000000000042.\uff10\uff10\uff10\uff13",
        "chunk-000000000042.0000\n",
        "\nchunk-000000000042.0000",
    ],
)
def test_parse_rejects_other_names(name: str) -> None:
    assert parse_chunk_file_name(name) is None
