"""Unit tests of the chunk engine: config, manager, writer, reader."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import xxhash
from chunk_helpers import (
    SMALL,
    Record,
    chunk_files,
    data_offset,
    frame_size,
    full_size,
    make_config,
    overwrite,
    payload,
    read_all,
    snapshot,
    write_all,
)

from equeue.chunks import (
    Chunk,
    ChunkFooter,
    ChunkHeader,
    ChunkManager,
    ChunkManagerConfig,
    ChunkReader,
    ChunkType,
    ChunkWriter,
)
from equeue.chunks.chunk import Records
from equeue.errors import (
    ChunkRemovedError,
    ClosedError,
    ConfigError,
    CorruptionError,
    InvalidRecordError,
    MissingChunkError,
    PositionNotFoundError,
    ReadOnlyError,
    RecordTooLargeError,
    TruncatedError,
    WriterExistsError,
)
from equeue.format.chunk import FOOTER_SIZE, FRAME_OVERHEAD, HEADER_SIZE, TEMP_SUFFIX

RECORDS_PER_CHUNK = 8  # 500-byte records: 512-byte frames, eight to a 4096-byte chunk


def rec500(i: int) -> bytes:
    return payload(i, 500)


def fill(directory: Path, count: int, **config: Any) -> list[Record]:
    """A closed store of ``count`` 500-byte records."""
    with ChunkManager(directory, make_config(**config)) as manager:
        return write_all(ChunkWriter(manager), (rec500(i) for i in range(count)))


def read_footer(path: Path) -> ChunkFooter:
    raw = path.read_bytes()
    return ChunkFooter.unpack(raw[-FOOTER_SIZE:], file=str(path), offset=len(raw) - FOOTER_SIZE)


def mapped_completed(manager: ChunkManager) -> int:
    return sum(1 for chunk in manager if chunk.is_mapped and chunk.is_completed)


# --- ChunkManagerConfig --------------------------------------------------------


def test_config_defaults_are_valid() -> None:
    config = ChunkManagerConfig()
    assert config.chunk_type is ChunkType.VARIABLE
    assert config.largest_record == config.max_record_size
    assert make_config(record_size=16).chunk_type is ChunkType.FIXED
    assert make_config(record_size=16).largest_record == 16
    assert make_config(max_record_size=1 << 20).largest_record == SMALL - FRAME_OVERHEAD
    # the boundaries themselves are accepted
    ChunkManagerConfig(chunk_data_size=4096, max_record_size=1)
    ChunkManagerConfig(chunk_data_size=1 << 31, max_record_size=(1 << 32) - 1)
    ChunkManagerConfig(chunk_data_size=4096, record_size=4096, max_open_chunks=1)
    ChunkManagerConfig(max_record_size=100, timestamp_offset=92)
    ChunkManagerConfig(chunk_data_size=4096, record_size=16, timestamp_offset=8)


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ({"chunk_data_size": 4095}, "chunk_data_size"),
        ({"chunk_data_size": (1 << 31) + 1}, "chunk_data_size"),
        ({"chunk_data_size": "4096"}, "chunk_data_size"),
        ({"chunk_data_size": 4096.0}, "chunk_data_size"),
        ({"chunk_data_size": True}, "chunk_data_size"),
        ({"chunk_data_size": 4096, "record_size": -1}, "record_size"),
        ({"chunk_data_size": 4096, "record_size": 8192}, "record_size"),
        ({"chunk_data_size": 4096, "record_size": 12}, "record_size"),  # not a divisor
        ({"max_record_size": 0}, "max_record_size"),
        ({"max_record_size": 1 << 32}, "max_record_size"),
        ({"max_record_size": None}, "max_record_size"),
        ({"max_open_chunks": 0}, "max_open_chunks"),
        ({"max_open_chunks": (1 << 16) + 1}, "max_open_chunks"),
        ({"max_open_chunks": False}, "max_open_chunks"),
        ({"sync_flush": 1}, "sync_flush"),
        ({"sync_flush": "yes"}, "sync_flush"),
        ({"timestamp_offset": -1}, "timestamp_offset"),
        ({"max_record_size": 100, "timestamp_offset": 93}, "timestamp_offset"),
        ({"chunk_data_size": 4096, "record_size": 16, "timestamp_offset": 9}, "timestamp_offset"),
        ({"timestamp_offset": "0"}, "timestamp_offset"),
    ],
)
def test_config_rejects_bad_setting(settings: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name) as info:
        ChunkManagerConfig(**settings)
    assert isinstance(info.value, ValueError)


# --- ChunkManager ------------------------------------------------------------------


def test_empty_directory(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "store"
    with ChunkManager(directory, make_config()) as manager:
        assert directory.is_dir()
        assert len(manager) == 0
        assert list(manager) == []
        assert manager.first_chunk is None
        assert manager.last_chunk is None
        assert manager.committed_position == 0
        assert manager.first_position == 0
        assert manager.recovery_cuts == []
        with pytest.raises(PositionNotFoundError):
            manager.get_chunk(0)
        with pytest.raises(PositionNotFoundError):
            manager.get_chunk_for(-1)
        assert read_all(manager) == []
        with pytest.raises(PositionNotFoundError):
            ChunkReader(manager).read(0)
    assert os.listdir(directory) == []


def test_add_new_chunk(tmp_path: Path) -> None:
    config = make_config(8192, timestamp_offset=4)
    with ChunkManager(tmp_path, config) as manager:
        chunk = manager.add_new_chunk()
        assert chunk.path == tmp_path / "chunk-000000000000.0000"
        assert chunk.path.stat().st_size == full_size(8192)
        assert manager.get_chunk(0) is chunk
        assert manager.last_chunk is chunk
        assert not chunk.is_completed
        raw = chunk.path.read_bytes()
        header = ChunkHeader.unpack(raw, file=str(chunk.path))
        assert header == chunk.header
        assert header.chunk_type is ChunkType.VARIABLE
        assert (header.chunk_start_number, header.chunk_end_number) == (0, 0)
        assert header.chunk_data_size == 8192
        assert header.record_size == 0
        assert header.timestamp_offset == 4
        assert ChunkFooter.is_blank(raw[-FOOTER_SIZE:])
        assert raw[HEADER_SIZE:] == bytes(8192 + FOOTER_SIZE)
        before = snapshot(tmp_path)
        with pytest.raises(CorruptionError, match="ongoing"):
            manager.add_new_chunk()  # the ongoing chunk must be completed first
        assert snapshot(tmp_path) == before
        chunk.complete()
        second = manager.add_new_chunk()
        assert second.start_number == 1
        assert [c.start_number for c in manager] == [0, 1]


def test_add_new_chunk_with_start_number(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        chunk = manager.add_new_chunk(start_number=5)
        assert chunk.path.name == "chunk-000000000005.0000"
        assert manager.first_position == 5 * SMALL
        assert manager.committed_position == 5 * SMALL
        with pytest.raises(ChunkRemovedError):
            manager.get_chunk(4)
        assert ChunkWriter(manager).write(b"x") == 5 * SMALL
        chunk.complete()
        with pytest.raises(ConfigError, match="start_number"):
            manager.add_new_chunk(start_number=9)
    with ChunkManager(tmp_path, make_config()) as manager:
        assert read_all(manager) == [(5 * SMALL, b"x")]


def test_chunk_numbers_past_twelve_digits_reload(tmp_path: Path) -> None:
    number = 10**12 + 3  # names get a 13th digit
    with ChunkManager(tmp_path, make_config()) as manager:
        manager.add_new_chunk(start_number=number)
        writer = ChunkWriter(manager)
        first = writer.write(b"far out")
        writer.complete()
        second = writer.write(b"next")
    assert (first, second) == (number * SMALL, (number + 1) * SMALL)
    with ChunkManager(tmp_path, make_config()) as manager:
        assert [c.start_number for c in manager] == [number, number + 1]
        assert read_all(manager) == [(first, b"far out"), (second, b"next")]


def test_get_chunk_for_and_iteration(tmp_path: Path) -> None:
    records = fill(tmp_path, 3 * RECORDS_PER_CHUNK + 3)
    with ChunkManager(tmp_path, make_config()) as manager:
        assert len(manager) == 4
        chunks = list(manager)
        assert [c.start_number for c in chunks] == [0, 1, 2, 3]
        assert manager.first_chunk is chunks[0]
        assert manager.last_chunk is chunks[3]
        assert [c.is_completed for c in chunks] == [True, True, True, False]
        for position, _ in records:
            chunk = manager.get_chunk_for(position)
            assert chunk.start_number == position // SMALL
            assert chunk is manager.get_chunk(position // SMALL)
        for number in range(4):
            for offset in (0, 1, SMALL - 1):
                assert manager.get_chunk_for(number * SMALL + offset) is chunks[number]
        with pytest.raises(PositionNotFoundError):
            manager.get_chunk_for(4 * SMALL)
        with pytest.raises(PositionNotFoundError):
            manager.get_chunk(4)
        assert manager.committed_position == 3 * SMALL + 3 * 512


def test_remove_chunks_before(tmp_path: Path) -> None:
    records = fill(tmp_path, 4 * RECORDS_PER_CHUNK + 1)  # chunks 0..4, 4 ongoing
    config = make_config()
    with ChunkManager(tmp_path, config) as manager:
        reader = ChunkReader(manager)
        assert reader.read(0) == records[0][1]  # chunk 0 is mapped now
        removed = manager.remove_chunks_before(2)
        assert [c.start_number for c in removed] == [0, 1]
        assert [p.name for p in chunk_files(tmp_path)] == [
            f"chunk-00000000000{n}.0000" for n in (2, 3, 4)
        ]
        assert manager.first_position == 2 * SMALL
        for position in (0, records[RECORDS_PER_CHUNK][0], 2 * SMALL - 1):
            with pytest.raises(ChunkRemovedError):
                reader.read(position)
            with pytest.raises(ChunkRemovedError):
                manager.get_chunk_for(position)
        assert list(reader.iter_from(0)) == records[2 * RECORDS_PER_CHUNK :]
        assert manager.remove_chunks_before(2) == []
        # never the last chunk, even when asked to remove everything
        removed = manager.remove_chunks_before(100)
        assert [c.start_number for c in removed] == [2, 3]
        assert [c.start_number for c in manager] == [4]
        assert read_all(manager) == records[-1:]
    with ChunkManager(tmp_path, config) as manager:
        assert [c.start_number for c in manager] == [4]
        with pytest.raises(ChunkRemovedError):
            ChunkReader(manager).read(records[0][0])
        assert read_all(manager) == records[-1:]
        assert ChunkWriter(manager).write(b"more") == records[-1][0] + 512


def test_remove_chunks_before_keeps_a_completed_last_chunk(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        write_all(writer, (rec500(i) for i in range(RECORDS_PER_CHUNK + 1)))
        writer.complete()
        assert manager.last_chunk is not None and manager.last_chunk.is_completed
        assert [c.start_number for c in manager.remove_chunks_before(10)] == [0]
        assert [c.start_number for c in manager] == [1]


def test_context_manager_closes(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        records = write_all(writer, (rec500(i) for i in range(RECORDS_PER_CHUNK + 2)))
        assert read_all(manager) == records
        assert any(chunk.is_mapped for chunk in manager)
    assert not any(chunk.is_mapped for chunk in manager)
    with pytest.raises(ClosedError):
        manager.add_new_chunk()
    with pytest.raises(ClosedError):
        manager.remove_chunks_before(1)
    with pytest.raises(ClosedError):
        manager.get_chunk(99)
    with pytest.raises(ClosedError):
        writer.write(b"after close")
    with pytest.raises(ClosedError):
        writer.write_many([b"after", b"close"])
    manager.close()  # a second close is harmless
    with ChunkManager(tmp_path, make_config()) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == records


def test_write_after_close_on_a_full_chunk_raises_closed(tmp_path: Path) -> None:
    manager = ChunkManager(tmp_path, make_config())
    writer = ChunkWriter(manager)
    writer.write(payload(1, SMALL - FRAME_OVERHEAD))  # the chunk is exactly full
    manager.close()
    before = snapshot(tmp_path)
    with pytest.raises(ClosedError):
        writer.write(b"x")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("setting", "value"), [("chunk_data_size", 8192), ("record_size", 16), ("record_size", 512)]
)
def test_reopen_with_other_layout_setting_is_refused(
    tmp_path: Path, setting: str, value: int
) -> None:
    fill(tmp_path, RECORDS_PER_CHUNK + 1)
    before = snapshot(tmp_path)
    settings: dict[str, Any] = {setting: value}
    config = make_config(**settings)
    with pytest.raises(ConfigError, match=f"{setting}=") as info:
        ChunkManager(tmp_path, config)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ConfigError, match=setting):
        ChunkManager(tmp_path, config, read_only=True)
    assert snapshot(tmp_path) == before


def test_reopen_with_smaller_max_record_size_keeps_records(tmp_path: Path) -> None:
    big = payload(1, 3000)
    with ChunkManager(tmp_path, make_config(max_record_size=4000)) as manager:
        records = write_all(ChunkWriter(manager), [big, b"small"])
    before = snapshot(tmp_path)
    with ChunkManager(tmp_path, make_config(max_record_size=1000)) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == records
        writer = ChunkWriter(manager)
        with pytest.raises(RecordTooLargeError):
            writer.write(big)
        assert writer.write(b"after") == frame_size(big) + frame_size(b"small")
    assert not (tmp_path / "recovered").exists()
    assert set(snapshot(tmp_path)) == set(before)


def test_read_only_manager_changes_nothing(tmp_path: Path) -> None:
    records = fill(tmp_path, RECORDS_PER_CHUNK + 3)
    last = chunk_files(tmp_path)[-1]
    # a torn tail (garbage after the last record) and a leftover temp file
    overwrite(last, data_offset(3 * 512 + 100), b"\x55" * 40)
    (tmp_path / f"chunk-000000000002.0000.abc{TEMP_SUFFIX}").write_bytes(b"half a chunk")
    before = snapshot(tmp_path)
    with ChunkManager(tmp_path, make_config(), read_only=True) as ro:
        assert ro.recovery_cuts == []
        assert read_all(ro) == records
        assert ChunkReader(ro).read(records[-1][0]) == records[-1][1]
        assert ro.committed_position == records[-1][0] + 512
        with pytest.raises(ReadOnlyError):
            ro.add_new_chunk()
        with pytest.raises(ReadOnlyError):
            ro.remove_chunks_before(5)
        with pytest.raises(ReadOnlyError):
            ChunkWriter(ro)
        ro.refresh()
        assert read_all(ro) == records
    assert snapshot(tmp_path) == before
    missing = tmp_path / "missing"
    with ChunkManager(missing, make_config(), read_only=True) as ro:
        assert len(ro) == 0
        ro.refresh()
        assert read_all(ro) == []
    assert not missing.exists()


def test_read_only_refresh_sees_a_writers_later_records(tmp_path: Path) -> None:
    with (
        ChunkManager(tmp_path, make_config()) as manager,
        ChunkManager(tmp_path, make_config(), read_only=True) as ro,
    ):
        writer = ChunkWriter(manager)
        records = write_all(writer, (rec500(i) for i in range(3)))
        assert read_all(ro) == []
        ro.refresh()  # the first chunk appears
        assert read_all(ro) == records
        # more records in the same chunk
        records += write_all(writer, (rec500(i) for i in range(3, 6)))
        assert read_all(ro) == records[:3]
        ro.refresh()
        assert read_all(ro) == records
        # across several new chunks
        records += write_all(writer, (rec500(i) for i in range(6, 3 * RECORDS_PER_CHUNK + 2)))
        ro.refresh()
        assert [c.start_number for c in ro] == [0, 1, 2, 3]
        assert [c.is_completed for c in ro] == [True, True, True, False]
        assert [c.footer for c in ro] == [c.footer for c in manager]
        assert ro.committed_position == manager.committed_position
        assert read_all(ro) == records
        reader = ChunkReader(ro)
        assert all(reader.read(position) == data for position, data in records)
        # the writer completes its chunk without starting another
        writer.complete()
        ro.refresh()
        assert [c.footer for c in ro] == [c.footer for c in manager]
        last = ro.last_chunk
        assert last is not None and last.is_completed
        assert read_all(ro) == records


def test_read_only_refresh_of_a_directory_created_later(tmp_path: Path) -> None:
    directory = tmp_path / "later"
    with ChunkManager(directory, make_config(), read_only=True) as ro:
        ro.refresh()
        assert not directory.exists()
        with ChunkManager(directory, make_config()) as manager:
            records = write_all(ChunkWriter(manager), (rec500(i) for i in range(12)))
            ro.refresh()
            assert read_all(ro) == records


def test_open_maps_stay_within_max_open_chunks(tmp_path: Path) -> None:
    records = fill(tmp_path, 10 * RECORDS_PER_CHUNK + 1, max_open_chunks=2)
    with ChunkManager(tmp_path, make_config(max_open_chunks=2)) as manager:
        reader = ChunkReader(manager)
        assert mapped_completed(manager) == 0
        firsts = records[::RECORDS_PER_CHUNK]
        for position, data in firsts[:-1] + firsts[::-3]:
            assert reader.read(position) == data
            assert manager.get_chunk_for(position).is_mapped
            assert mapped_completed(manager) <= 2
        seen = []
        for record in reader.iter_from(0):
            seen.append(record)
            assert mapped_completed(manager) <= 2
        assert seen == records
        assert mapped_completed(manager) == 2


# --- ChunkWriter -----------------------------------------------------------------


def test_write_returns_positions(tmp_path: Path) -> None:
    sizes = [1, 2, 100, 7, 1000, 3000, 50, 4084, 1, 12]
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        expected = []
        position = 0
        for i, size in enumerate(sizes):
            data = payload(i, size)
            if position % SMALL + frame_size(data) > SMALL:
                position = (position // SMALL + 1) * SMALL
            expected.append((position, data))
            assert writer.write(data) == position
            position += frame_size(data)
            assert writer.committed_position == manager.committed_position == position
        assert read_all(manager) == expected
    with ChunkManager(tmp_path, make_config()) as manager:
        assert read_all(manager) == expected


def test_rollover_completes_the_previous_chunk(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        records = write_all(writer, (rec500(i) for i in range(RECORDS_PER_CHUNK - 1)))
        records += write_all(writer, [payload(99, 300)])  # 312 bytes left after, then full
        first = manager.get_chunk(0)
        assert not first.is_completed
        assert ChunkFooter.is_blank(first.path.read_bytes()[-FOOTER_SIZE:])
        position = writer.write(rec500(100))
        assert position == SMALL
        assert first.is_completed
        footer = read_footer(first.path)
        assert footer == first.footer
        physical = 7 * 512 + frame_size(payload(99, 300))
        assert footer.completed
        assert footer.record_count == 8
        assert footer.physical_data_size == footer.logical_data_size == physical
        assert footer.map_entry_count == 0
        assert (footer.first_timestamp, footer.last_timestamp) == (None, None)
        raw = first.path.read_bytes()
        assert footer.checksum == xxhash.xxh3_64_intdigest(raw[: HEADER_SIZE + physical])
        assert raw[HEADER_SIZE + physical : -FOOTER_SIZE] == bytes(SMALL - physical)
        assert not manager.get_chunk(1).is_completed
        assert read_all(manager) == [*records, (SMALL, rec500(100))]


def timestamped(ts: int, size: int = 40) -> bytes:
    return b"hdr." + ts.to_bytes(8, "little", signed=True) + payload(ts & 0xFFFF, size - 12)


def test_footer_timestamps(tmp_path: Path) -> None:
    config = make_config(timestamp_offset=4)
    stamps = [-(1 << 62), 5, 17, 1_700_000_000_123_456_789, 3]
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        with pytest.raises(InvalidRecordError, match="timestamp_offset=4"):
            writer.write(b"hdr.1234567")  # 11 bytes: the timestamp does not fit
        writer.write(timestamped(stamps[0]))
        writer.write(timestamped(stamps[1], 2000))
    with ChunkManager(tmp_path, config) as manager:  # the writer resumes a reopened chunk
        writer = ChunkWriter(manager)
        writer.write(timestamped(stamps[2], 1000))
        writer.write(timestamped(stamps[3], 2000))  # does not fit: completes chunk 0
        writer.write(timestamped(stamps[4], 13))
        writer.complete()
        footers = [chunk.footer for chunk in manager]
    assert [read_footer(path) for path in chunk_files(tmp_path)] == footers
    assert footers[0] is not None and footers[1] is not None
    assert (footers[0].first_timestamp, footers[0].last_timestamp) == (stamps[0], stamps[2])
    assert footers[0].record_count == 3
    assert (footers[1].first_timestamp, footers[1].last_timestamp) == (stamps[3], stamps[4])
    assert footers[1].record_count == 2


def test_fixed_size_footer_timestamps(tmp_path: Path) -> None:
    config = make_config(SMALL, record_size=16, timestamp_offset=8)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        for ts in range(1, 300):
            writer.write(b"\x01" * 8 + (ts * 10).to_bytes(8, "little"))
        footer = manager.get_chunk(0).footer
    assert footer is not None
    assert footer.record_count == 256
    assert (footer.first_timestamp, footer.last_timestamp) == (10, 2560)


def test_exact_fit_record_stays_in_its_chunk(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        first = payload(1, 1000)
        exact = payload(2, SMALL - frame_size(first) - FRAME_OVERHEAD)
        assert writer.write(first) == 0
        assert writer.write(exact) == frame_size(first)
        chunk = manager.get_chunk(0)
        assert chunk.data_end == SMALL
        assert manager.committed_position == SMALL
        assert len(manager) == 1
        assert writer.write(b"z") == SMALL
        assert chunk.footer is not None
        assert chunk.footer.physical_data_size == SMALL
        assert chunk.footer.record_count == 2
        expected = [(0, first), (frame_size(first), exact), (SMALL, b"z")]
        assert read_all(manager) == expected
    with ChunkManager(tmp_path, make_config()) as manager:
        assert read_all(manager) == expected


def test_exactly_full_chunk_reopens_and_rolls_over(tmp_path: Path) -> None:
    whole = payload(3, SMALL - FRAME_OVERHEAD)
    with ChunkManager(tmp_path, make_config()) as manager:
        assert ChunkWriter(manager).write(whole) == 0
    with ChunkManager(tmp_path, make_config()) as manager:
        assert manager.recovery_cuts == []
        assert manager.committed_position == SMALL
        assert ChunkWriter(manager).write(b"next") == SMALL
        assert read_all(manager) == [(0, whole), (SMALL, b"next")]


def test_one_byte_over_goes_to_the_next_chunk(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        first = payload(1, 1000)
        over = payload(2, SMALL - frame_size(first) - FRAME_OVERHEAD + 1)
        assert writer.write(first) == 0
        assert writer.write(over) == SMALL
        footer = manager.get_chunk(0).footer
        assert footer is not None
        assert footer.physical_data_size == frame_size(first)
        assert footer.record_count == 1
        assert read_all(manager) == [(0, first), (SMALL, over)]


@pytest.mark.parametrize(
    ("max_record_size", "size", "setting"),
    [
        (1000, 1001, "max_record_size"),
        (1000, 5000, "max_record_size"),
        (SMALL, SMALL - FRAME_OVERHEAD + 1, "chunk_data_size"),
        (1 << 20, SMALL, "chunk_data_size"),
        (1 << 20, 100_000, "chunk_data_size"),
    ],
)
def test_record_too_large_writes_nothing(
    tmp_path: Path, max_record_size: int, size: int, setting: str
) -> None:
    config = make_config(max_record_size=max_record_size)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        with pytest.raises(RecordTooLargeError, match=setting):
            writer.write(payload(0, size))  # into an empty directory: no chunk is created
        assert os.listdir(tmp_path) == []
        records = write_all(writer, [payload(1, 700), payload(2, 10)])
        committed = writer.committed_position
        before = snapshot(tmp_path)
        with pytest.raises(RecordTooLargeError, match=setting):
            writer.write(payload(3, size))
        with pytest.raises(RecordTooLargeError, match=setting):
            cast(Any, writer).write(bytearray(size))  # the slow path for bytes-likes
        assert writer.committed_position == manager.committed_position == committed
        writer.flush()
        assert snapshot(tmp_path) == before
        assert read_all(manager) == records


def test_largest_record_fits_an_empty_chunk(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config(max_record_size=1 << 20)) as manager:
        writer = ChunkWriter(manager)
        largest = payload(5, SMALL - FRAME_OVERHEAD)
        assert writer.write(b"a") == 0
        assert writer.write(largest) == SMALL
        assert read_all(manager) == [(0, b"a"), (SMALL, largest)]


@pytest.mark.parametrize("bad", [b"", bytearray(), "text", 42, None, [1, 2], memoryview(b"")])
def test_empty_or_wrongly_typed_record_is_rejected(tmp_path: Path, bad: Any) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        records = write_all(writer, [b"one"])
        before = snapshot(tmp_path)
        with pytest.raises(InvalidRecordError):
            writer.write(bad)
        with pytest.raises(InvalidRecordError):
            writer.write_many([b"ok", bad])
        assert writer.committed_position == frame_size(b"one")
        assert snapshot(tmp_path) == before
        assert read_all(manager) == records


def test_bytes_like_records_are_accepted(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        loose: Any = writer  # write() is annotated `bytes`, but takes any bytes-like object
        positions = [loose.write(bytearray(b"ba")), loose.write(memoryview(b"xmvx")[1:3])]
        assert read_all(manager) == [(positions[0], b"ba"), (positions[1], b"mv")]


def test_write_many(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config(max_record_size=2000)) as manager:
        writer = ChunkWriter(manager)
        batch = [rec500(i) for i in range(RECORDS_PER_CHUNK + 3)]
        positions = writer.write_many(batch)
        assert positions == [i * 512 for i in range(len(batch))]
        assert writer.write_many([]) == []
        before = snapshot(tmp_path)
        committed = writer.committed_position
        for bad_batch, error in [
            ([rec500(50), rec500(51), b"", rec500(52)], InvalidRecordError),
            ([rec500(50), payload(9, 2001)], RecordTooLargeError),
            ([rec500(50)] * RECORDS_PER_CHUNK + ["str"], InvalidRecordError),
        ]:
            with pytest.raises(error):
                writer.write_many(bad_batch)  # type: ignore[arg-type]
            assert writer.committed_position == committed
            assert snapshot(tmp_path) == before
        assert read_all(manager) == list(zip(positions, batch, strict=True))


def test_fixed_size_records(tmp_path: Path) -> None:
    config = make_config(4104, record_size=12)  # 342 records per chunk
    records = [(i * 12, payload(i, 12)) for i in range(500)]
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        for bad in (bytes(12), bytes(11), payload(1, 11), payload(1, 13), b"", "x" * 12):
            with pytest.raises(InvalidRecordError):
                writer.write(bad)  # type: ignore[arg-type]
        assert os.listdir(tmp_path) == []
        assert [writer.write(data) for _, data in records[:400]] == [p for p, _ in records[:400]]
        with pytest.raises(InvalidRecordError, match="all-zero"):
            writer.write_many([payload(7, 12), bytes(12)])
        assert writer.write_many([data for _, data in records[400:]]) == [
            p for p, _ in records[400:]
        ]
        assert manager.get_chunk(0).footer is not None
        assert manager.get_chunk(0).footer.record_count == 342  # type: ignore[union-attr]
    with ChunkManager(tmp_path, config) as manager:
        assert manager.recovery_cuts == []
        assert manager.committed_position == 500 * 12
        assert read_all(manager) == records
        reader = ChunkReader(manager)
        assert reader.read(342 * 12) == records[342][1]
        assert ChunkWriter(manager).write(payload(500, 12)) == 500 * 12
        assert reader.read(500 * 12) == payload(500, 12)


def test_fixed_size_records_with_zero_runs_reopen(tmp_path: Path) -> None:
    # Zero runs that straddle two slots must not be taken for the empty end.
    config = make_config(4104, record_size=12)
    records = [
        b"\x01" + bytes(11),
        bytes(11) + b"\x02",
        bytes(5) + b"\x03" + bytes(6),
        b"\x04" * 12,
    ]
    with ChunkManager(tmp_path, config) as manager:
        write_all(ChunkWriter(manager), records)
    with ChunkManager(tmp_path, config) as manager:
        assert read_all(manager) == [(i * 12, r) for i, r in enumerate(records)]
        assert manager.committed_position == 48


def test_fixed_size_positions_off_the_record_grid(tmp_path: Path) -> None:
    config = make_config(4104, record_size=12)
    records = [(i * 12, payload(i, 12)) for i in range(3)]
    with ChunkManager(tmp_path, config) as manager:
        write_all(ChunkWriter(manager), (data for _, data in records))
        reader = ChunkReader(manager)
        for position in (1, 5, 11, 13, 30, 35):
            with pytest.raises(PositionNotFoundError, match="record boundary"):
                reader.read(position)
        assert list(reader.iter_from(1)) == records[1:]
        assert list(reader.iter_from(12)) == records[1:]
        assert list(reader.iter_from(25)) == []
        with pytest.raises(PositionNotFoundError):
            reader.read(36)


def test_sync_flush(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        writer.write(rec500(0))
        assert writer.flushed_position == 0  # without sync_flush: only after flush()
        writer.flush()
        assert writer.flushed_position == writer.committed_position == 512
    with ChunkManager(tmp_path, make_config(sync_flush=True)) as manager:
        writer = ChunkWriter(manager)
        for i in range(1, 2 * RECORDS_PER_CHUNK + 2):
            writer.write(rec500(i))
            assert writer.flushed_position == writer.committed_position
        writer.write_many([rec500(i) for i in range(100, 110)])
        assert writer.flushed_position == writer.committed_position
        records = read_all(manager)
    assert len(records) == 2 * RECORDS_PER_CHUNK + 12
    with ChunkManager(tmp_path, make_config(sync_flush=True)) as manager:
        assert read_all(manager) == records


def test_second_writer_is_refused(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        with pytest.raises(WriterExistsError):
            ChunkWriter(manager)
        assert writer.write(b"still works") == 0


# --- ChunkReader -----------------------------------------------------------------


def test_reader_across_chunk_boundaries(tmp_path: Path) -> None:
    sizes = [3000, 900, 2000, 4084, 10, 2500, 2500, 1]
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        records = write_all(writer, (payload(i, s) for i, s in enumerate(sizes)))
        assert [p // SMALL for p, _ in records] == [0, 0, 1, 2, 3, 3, 4, 4]
        reader = ChunkReader(manager)
        for i, (position, data) in enumerate(records):
            assert reader.read(position) == data
            assert list(reader.iter_from(position)) == records[i:]
        # a position in the unused tail of a completed chunk starts at the next chunk
        tail_of_0 = records[1][0] + frame_size(records[1][1])
        for position in (tail_of_0, tail_of_0 + 1, SMALL - 1):
            assert list(reader.iter_from(position)) == records[2:]
            with pytest.raises(PositionNotFoundError):
                reader.read(position)
        assert list(reader.iter_from(-5)) == records
        # never past the committed end
        end = manager.committed_position
        assert end == records[-1][0] + frame_size(records[-1][1])
        assert list(reader.iter_from(end)) == []
        assert list(reader.iter_from(end + 100)) == []
        for position in (end, end + 1, end + 100, 10 * SMALL):
            with pytest.raises(PositionNotFoundError):
                reader.read(position)
        assert reader.read(records[-1][0]) == records[-1][1]
        # a generator keeps up with later writes to the ongoing chunk
        stream = reader.iter_from(records[-1][0])
        assert next(stream) == records[-1]
        later = writer.write(b"later")
        assert next(stream) == (later, b"later")
        assert list(stream) == []


def test_reader_does_not_skip_records_added_while_a_chunk_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic replay of a race: the writer runs right after the reader reached the
    committed end of the ongoing chunk, appends a record there and rolls over."""
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        reader = ChunkReader(manager)
        records = write_all(writer, [b"a" * 100])
        original = Chunk.iter_records
        interleaved: list[Record] = []

        def iter_then_write(chunk: Chunk, local: int, base: int = 0) -> Records:
            resume = yield from original(chunk, local, base)
            if not interleaved:
                interleaved.extend(write_all(writer, [b"R" * 100, payload(1, 3900)]))
            return resume

        monkeypatch.setattr(Chunk, "iter_records", iter_then_write)
        seen = list(reader.iter_from(0))
        assert [p // SMALL for p, _ in interleaved] == [0, 1]
        assert seen == records + interleaved


def test_reader_thread_sees_whole_records_in_order(tmp_path: Path) -> None:
    count = 2500
    config = make_config(max_open_chunks=2)

    def record(i: int) -> bytes:
        return i.to_bytes(4, "little") + payload(i, 1 + (i * 37) % 700)

    errors: list[BaseException] = []
    seen: list[Record] = []
    written: list[int] = []
    done = threading.Event()

    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        reader = ChunkReader(manager)

        def write() -> None:
            try:
                for i in range(count):
                    if i % 50 == 0:
                        written.extend(writer.write_many([record(i)]))
                    else:
                        written.append(writer.write(record(i)))
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        def read() -> None:
            try:
                position = 0
                while len(seen) < count:
                    finished = done.is_set()
                    for found, data in reader.iter_from(position):
                        i = int.from_bytes(data[:4], "little")
                        assert i == len(seen), f"record {i} at {found}, expected {len(seen)}"
                        assert data == record(i)
                        assert found >= position
                        seen.append((found, data))
                        position = found + frame_size(data)
                    if finished and len(seen) < count:
                        raise AssertionError(f"stuck at {len(seen)} of {count} records")
            except BaseException as exc:
                errors.append(exc)

        old_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # switch threads often, to interleave more
        try:
            threads = [threading.Thread(target=write), threading.Thread(target=read)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)  # a hang guard, not a timing assertion
        finally:
            sys.setswitchinterval(old_interval)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == []
        assert [p for p, _ in seen] == written
        assert len(manager) > 100
        assert read_all(manager) == seen


# --- loading -----------------------------------------------------------------------


def test_missing_chunk_in_the_middle_changes_nothing(tmp_path: Path) -> None:
    fill(tmp_path, 4 * RECORDS_PER_CHUNK + 3)
    files = chunk_files(tmp_path)
    files[2].unlink()
    # things a successful load would change: a temp file, a torn tail
    (tmp_path / f"{files[4].name}.1f2e{TEMP_SUFFIX}").write_bytes(b"junk")
    overwrite(files[-1], data_offset(3 * 512), b"\xaa" * 30)
    before = snapshot(tmp_path)
    for read_only in (False, True):
        with pytest.raises(MissingChunkError) as info:
            ChunkManager(tmp_path, make_config(), read_only=read_only)
        message = str(info.value)
        assert "chunks 2..2 are missing" in message
        assert files[1].name in message and files[3].name in message
        assert info.value.file == str(files[3])
        assert snapshot(tmp_path) == before


def test_truncated_middle_chunk_is_refused(tmp_path: Path) -> None:
    fill(tmp_path, 2 * RECORDS_PER_CHUNK + 1)
    middle = chunk_files(tmp_path)[1]
    os.truncate(middle, full_size() - 1)
    before = snapshot(tmp_path)
    with pytest.raises(TruncatedError) as info:
        ChunkManager(tmp_path, make_config())
    assert info.value.file == str(middle)
    assert str(middle) in str(info.value)
    assert snapshot(tmp_path) == before


def test_leftover_temp_files_are_removed_at_load(tmp_path: Path) -> None:
    records = fill(tmp_path, RECORDS_PER_CHUNK + 2)
    temps = [
        tmp_path / f"chunk-000000000002.0000.0123456789abcdef{TEMP_SUFFIX}",
        tmp_path / f"chunk-000000000000.0001.feed{TEMP_SUFFIX}",
    ]
    for temp in temps:
        temp.write_bytes(b"EQCH" + bytes(200))
    (tmp_path / "notes.txt").write_bytes(b"not ours")
    chunks_before = {p.name: p.read_bytes() for p in chunk_files(tmp_path)}
    with ChunkManager(tmp_path, make_config(), read_only=True):
        pass
    assert all(temp.exists() for temp in temps)  # read-only: left alone
    with ChunkManager(tmp_path, make_config()) as manager:
        assert not any(temp.exists() for temp in temps)
        assert (tmp_path / "notes.txt").exists()
        assert manager.recovery_cuts == []
        assert read_all(manager) == records
    assert {p.name: p.read_bytes() for p in chunk_files(tmp_path)} == chunks_before


def test_chunk_holding_only_a_header_reopens(tmp_path: Path) -> None:
    with ChunkManager(tmp_path, make_config()) as manager:
        manager.add_new_chunk()
    for truncate in (False, True):
        path = chunk_files(tmp_path)[0]
        if truncate:
            os.truncate(path, HEADER_SIZE)  # nothing but the header
        with ChunkManager(tmp_path, make_config()) as manager:
            assert manager.recovery_cuts == []
            assert path.stat().st_size == full_size()
            assert len(manager) == 1
            assert manager.committed_position == 0
            assert read_all(manager) == []
    with ChunkManager(tmp_path, make_config()) as manager:
        assert ChunkWriter(manager).write(b"first") == 0
    with ChunkManager(tmp_path, make_config()) as manager:
        assert read_all(manager) == [(0, b"first")]


def test_header_only_last_chunk_after_completed_chunks(tmp_path: Path) -> None:
    records = fill(tmp_path, RECORDS_PER_CHUNK)  # chunk 0 exactly full, still ongoing
    with ChunkManager(tmp_path, make_config()) as manager:
        writer = ChunkWriter(manager)
        writer.complete()
        manager.add_new_chunk()
    os.truncate(chunk_files(tmp_path)[1], HEADER_SIZE)
    with ChunkManager(tmp_path, make_config()) as manager:
        assert manager.recovery_cuts == []
        assert manager.committed_position == SMALL
        assert ChunkWriter(manager).write(b"resumed") == SMALL
        assert read_all(manager) == [*records, (SMALL, b"resumed")]


def test_no_part_of_chunk_defines_a_field_the_c_sender_reads() -> None:
    # Chunk is assembled from base classes (chunkstate.py, mapping.py, ...). The C Sender
    # remembers these fields from a chunk's instance dict only while no class in its MRO
    # defines them (equeue/cext/sendstate.c, seen_fill); a default on a part would make
    # every send read them by attribute, with no test of the store's results failing.
    read_by_c = {"_mm", "data_end", "writable_end", "record_count", "_prefault_mark", "base"}
    defined = {
        (cls.__name__, name) for cls in Chunk.__mro__ for name in read_by_c & vars(cls).keys()
    }
    assert defined == set()
