"""Recovery of a damaged chunk directory: what is kept, what is cut, and where it goes.

Every damaged case asserts the exact list of records that survive, the exact cuts
(offset, length and the side file's bytes), and that writing resumes at the cut.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import pytest
from chunk_helpers import (
    SMALL,
    Record,
    chunk_files,
    data_offset,
    flip_byte,
    footer_offset,
    frame_size,
    full_size,
    make_config,
    overwrite,
    payload,
    read_all,
    snapshot,
    write_all,
)
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import given, settings
from hypothesis import strategies as st

from equeue.chunks import ChunkManager, ChunkWriter, TailCut
from equeue.chunks.recovery import (
    SCAN_STEP,
    TailHint,
    nonzero_extent,
    scan_fixed,
)
from equeue.errors import ChecksumMismatchError, CorruptionError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, RECOVERED_DIR, ChunkHeader

# Recovery's scans have a C path (scan_frames, last_nonzero): every test runs on both.
pytestmark = pytest.mark.usefixtures("code_path")

# Chunks 0 and 1 hold eight 500-byte records each (exactly full); the last chunk, 2,
# holds records of these sizes. 256 has a zero low byte in its length prefix.
LAST_SIZES = [1, 255, 256, 300, 17, 1000, 64, 500]
LAST_START = 2 * SMALL
FIXED_CONFIG = make_config(4104, record_size=12)


def boundaries() -> list[int]:
    """Chunk-relative offsets of the record starts in the last chunk, plus its data end."""
    offsets = [0]
    for size in LAST_SIZES:
        offsets.append(offsets[-1] + size + 12)
    return offsets


DATA_END = boundaries()[-1]


def build(directory: Path, *, complete_last: bool = False) -> list[Record]:
    with ChunkManager(directory, make_config()) as manager:
        writer = ChunkWriter(manager)
        records = write_all(writer, (payload(i, 500) for i in range(16)))
        records += write_all(writer, (payload(100 + i, s) for i, s in enumerate(LAST_SIZES)))
        if complete_last:
            writer.complete()
    assert [p for p, _ in records[16:]] == [LAST_START + b for b in boundaries()[:-1]]
    return records


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Record]]:
    directory = tmp_path_factory.mktemp("pristine")
    return directory, build(directory)


@pytest.fixture(scope="module")
def pristine_completed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Record]]:
    directory = tmp_path_factory.mktemp("pristine-completed")
    return directory, build(directory, complete_last=True)


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def last_file(directory: Path) -> Path:
    return chunk_files(directory)[-1]


def kept_records(records: list[Record], local_end: int) -> list[Record]:
    """Records wholly before chunk-relative offset ``local_end`` of the last chunk."""
    return [
        (p, r) for p, r in records if p < LAST_START or p - LAST_START + frame_size(r) <= local_end
    ]


def expected_cut(damaged: bytes, start: int, stop: int) -> tuple[int, int] | None:
    """(offset, length) recovery must cut from [start, stop): up to the last non-zero byte."""
    nonzero = len(damaged[start:stop].rstrip(b"\0"))
    return (start, nonzero) if nonzero else None


def check_cuts(
    directory: Path, cuts: list[TailCut], damaged: bytes, expected: list[tuple[int, int]]
) -> None:
    path = last_file(directory)
    assert [(cut.offset, cut.length) for cut in cuts] == expected
    after = path.read_bytes()
    for cut in cuts:
        assert cut.file == str(path)
        side = Path(cut.side_file)
        assert side.parent == directory / RECOVERED_DIR
        assert side.read_bytes() == damaged[cut.offset : cut.offset + cut.length]
        assert after[cut.offset : cut.offset + cut.length] == bytes(cut.length)
        assert str(cut.offset) in str(cut) and cut.side_file in str(cut)
    if not cuts:
        assert not (directory / RECOVERED_DIR).exists()
    else:
        assert sorted(os.listdir(directory / RECOVERED_DIR)) == sorted(
            Path(cut.side_file).name for cut in cuts
        )


def recover(
    directory: Path,
    expected_records: list[Record],
    resume_at: int,
    expected_cuts: list[tuple[int, int]],
) -> list[TailCut]:
    """Reopen a damaged store and check everything recovery promises."""
    damaged = last_file(directory).read_bytes()
    with ChunkManager(directory, make_config()) as manager:
        cuts = list(manager.recovery_cuts)
        check_cuts(directory, cuts, damaged, expected_cuts)
        assert read_all(manager) == expected_records
        last = manager.last_chunk
        assert last is not None and not last.is_completed
        assert last.path.stat().st_size == full_size()
        raw = last.path.read_bytes()
        assert raw[HEADER_SIZE + resume_at :] == bytes(full_size() - HEADER_SIZE - resume_at)
        assert manager.committed_position == LAST_START + resume_at
        writer = ChunkWriter(manager)
        more = write_all(writer, [b"after recovery", payload(7, 3000), payload(8, 2000)])
        assert more[0][0] == LAST_START + resume_at
        assert read_all(manager) == expected_records + more
    with ChunkManager(directory, make_config()) as manager:
        assert manager.recovery_cuts == []  # recovery is done once
        assert read_all(manager) == expected_records + more
    return cuts


# --- the control case ----------------------------------------------------------


def test_undamaged_store_reopens_unchanged(
    pristine: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    before = snapshot(directory)
    with ChunkManager(directory, make_config()) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == pristine[1]
        assert [c.is_completed for c in manager] == [True, True, False]
    assert snapshot(directory) == before
    recover(directory, pristine[1], DATA_END, [])


def test_undamaged_completed_store_reopens_unchanged(
    pristine_completed: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine_completed[0], tmp_path / "store")
    before = snapshot(directory)
    with ChunkManager(directory, make_config()) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == pristine_completed[1]
        assert [c.is_completed for c in manager] == [True, True, True]
        assert ChunkWriter(manager).write(b"x") == 3 * SMALL
    assert set(snapshot(directory)) == {*before, "chunk-000000000003.0000"}


# --- truncation ------------------------------------------------------------------


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("index", range(len(LAST_SIZES) + 1))
def test_truncated_last_chunk(
    pristine: tuple[Path, list[Record]], tmp_path: Path, index: int, extra: int
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    boundary = boundaries()[index]
    path = last_file(directory)
    os.truncate(path, data_offset(boundary + extra))
    damaged = path.read_bytes()
    cut = expected_cut(damaged, data_offset(boundary), len(damaged))
    if extra == 0:
        assert cut is None
    elif index < len(LAST_SIZES) and LAST_SIZES[index] != 256:
        assert cut == (data_offset(boundary), 1)  # the low byte of the length prefix
    else:
        assert cut is None  # that byte is zero (a zero length, or the unused tail)
    kept = pristine[1][: 16 + index]
    assert kept_records(pristine[1], boundary + extra) == kept
    recover(directory, kept, boundary, [cut] if cut else [])


@settings(max_examples=40, deadline=None)
@given(cut_at=st.integers(0, DATA_END + 20))
def test_truncated_anywhere_keeps_whole_records(
    pristine: tuple[Path, list[Record]], tmp_path_factory: pytest.TempPathFactory, cut_at: int
) -> None:
    directory = copy_of(pristine[0], tmp_path_factory.mktemp("cut") / "store")
    path = last_file(directory)
    os.truncate(path, data_offset(cut_at))
    damaged = path.read_bytes()
    kept = kept_records(pristine[1], cut_at)
    resume = max(b for b in boundaries() if b <= cut_at)
    assert len(kept) == 16 + boundaries().index(resume)
    cut = expected_cut(damaged, data_offset(resume), len(damaged))
    recover(directory, kept, resume, [cut] if cut else [])


def test_truncated_completed_last_chunk(
    pristine_completed: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine_completed[0], tmp_path / "store")
    path = last_file(directory)
    boundary = boundaries()[5]
    os.truncate(path, data_offset(boundary + 3))
    damaged = path.read_bytes()
    cut = (data_offset(boundary), 2)  # e8 03 of the length prefix 1000; its 00 is not copied
    assert expected_cut(damaged, data_offset(boundary), len(damaged)) == cut
    recover(directory, pristine_completed[1][:21], boundary, [cut])


def test_truncated_fixed_size_last_chunk(tmp_path: Path) -> None:
    records = [(i * 12, payload(i, 12)) for i in range(400)]  # 342 to a chunk
    with ChunkManager(tmp_path, FIXED_CONFIG) as manager:
        write_all(ChunkWriter(manager), (r for _, r in records))
    path = last_file(tmp_path)
    os.truncate(path, data_offset(50 * 12 + 5))  # 50 whole records and 5 bytes of one
    damaged = path.read_bytes()
    with ChunkManager(tmp_path, FIXED_CONFIG) as manager:
        assert [(c.offset, c.length) for c in manager.recovery_cuts] == [(data_offset(600), 5)]
        side = Path(manager.recovery_cuts[0].side_file).read_bytes()
        assert side == damaged[data_offset(600) :]
        assert read_all(manager) == records[: 342 + 50]
        assert path.stat().st_size == full_size(4104)
        assert ChunkWriter(manager).write(payload(1, 12)) == 392 * 12
    with ChunkManager(tmp_path, FIXED_CONFIG) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == [*records[:392], (392 * 12, payload(1, 12))]


# --- damaged data ------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_damaged_last_chunk_keeps_the_valid_prefix(
    pristine: tuple[Path, list[Record]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    offset = data.draw(st.integers(0, DATA_END - 1), label="offset")
    length = data.draw(st.integers(1, min(40, DATA_END - offset)), label="length")
    zeros = data.draw(st.booleans(), label="zeros")
    junk = bytes(length) if zeros else data.draw(st.binary(min_size=length, max_size=length))
    directory = copy_of(pristine[0], tmp_path_factory.mktemp("damage") / "store")
    path = last_file(directory)
    original = path.read_bytes()
    overwrite(path, data_offset(offset), junk)
    damaged = path.read_bytes()
    changed = [i for i in range(len(original)) if original[i] != damaged[i]]
    if not changed:  # the "damage" rewrote the same bytes: nothing is lost
        recover(directory, pristine[1], DATA_END, [])
        return
    first = changed[0] - HEADER_SIZE
    index = max(i for i, b in enumerate(boundaries()) if b <= first)  # the first bad record
    resume = boundaries()[index]
    cut = expected_cut(damaged, data_offset(resume), data_offset(SMALL))
    recover(directory, pristine[1][: 16 + index], resume, [cut] if cut else [])


@pytest.mark.parametrize("index", range(len(LAST_SIZES)))
@pytest.mark.parametrize("where", ["length", "payload", "checksum", "suffix"])
def test_each_frame_field_damaged(
    pristine: tuple[Path, list[Record]], tmp_path: Path, index: int, where: str
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    start = boundaries()[index]
    size = LAST_SIZES[index]
    at = {"length": 0, "payload": 4 + size // 2, "checksum": 4 + size, "suffix": 8 + size}[where]
    flip_byte(path, data_offset(start + at), 0x10)
    damaged = path.read_bytes()
    cut = expected_cut(damaged, data_offset(start), data_offset(SMALL))
    assert cut is not None
    # up to the end of the last record, whose length suffix (500) ends with two zero bytes
    assert cut[0] + cut[1] == data_offset(DATA_END) - 2
    recover(directory, pristine[1][: 16 + index], start, [cut])


def test_garbage_after_the_last_record_is_cut(
    pristine: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    overwrite(path, data_offset(DATA_END + 100), b"\x01\x02\x03")  # a zero gap, then junk
    cut = (data_offset(DATA_END), 103)
    recover(directory, pristine[1], DATA_END, [cut])


# --- damaged footers -----------------------------------------------------------------

FOOTER_BYTES = [0, 4, 8, 16, 32, 40, 56, 60, 63, 64, 123, 124, 127]


@pytest.mark.parametrize("index", [*FOOTER_BYTES, "blank"])
@pytest.mark.parametrize("read_only", [False, True])
def test_damaged_footer_of_a_middle_chunk_is_refused(
    pristine: tuple[Path, list[Record]], tmp_path: Path, index: int | str, read_only: bool
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    middle = chunk_files(directory)[1]
    at = footer_offset()
    if index == "blank":
        overwrite(middle, at, bytes(FOOTER_SIZE))
    else:
        assert isinstance(index, int)
        flip_byte(middle, at + index, 0x04)
    before = snapshot(directory)
    with pytest.raises(CorruptionError) as info:
        ChunkManager(directory, make_config(), read_only=read_only)
    error = info.value
    if isinstance(index, int) and index >= 4:
        assert isinstance(error, ChecksumMismatchError)
    assert error.file == str(middle)
    assert error.offset == at
    assert str(middle) in str(error)
    assert f"at offset {at} (0x{at:x})" in str(error)
    assert snapshot(directory) == before


@pytest.mark.parametrize("index", FOOTER_BYTES)
def test_damaged_footer_of_the_last_chunk_is_cut(
    pristine_completed: tuple[Path, list[Record]], tmp_path: Path, index: int
) -> None:
    directory = copy_of(pristine_completed[0], tmp_path / "store")
    path = last_file(directory)
    flip_byte(path, footer_offset() + index, 0x04)
    damaged = path.read_bytes()
    cut = expected_cut(damaged, footer_offset(), full_size())
    assert cut is not None and cut[1] > 120  # the footer's checksum is rarely zero at its end
    cuts = recover(directory, pristine_completed[1], DATA_END, [cut])
    assert cuts[0].reason == "torn footer"


@pytest.mark.parametrize("written", [0, 1, 4, 8, 40, 64, 124, 127, FOOTER_SIZE])
def test_torn_footer_on_the_last_chunk(
    pristine_completed: tuple[Path, list[Record]], tmp_path: Path, written: int
) -> None:
    """Only the first ``written`` bytes of the footer reached the disk (all of them: the
    control)."""
    directory = copy_of(pristine_completed[0], tmp_path / "store")
    path = last_file(directory)
    intact = path.read_bytes()
    overwrite(path, footer_offset() + written, bytes(FOOTER_SIZE - written))
    damaged = path.read_bytes()
    if damaged == intact:  # the bytes "lost" were zeros (the footer's last, 1 time in 256)
        with ChunkManager(directory, make_config()) as manager:  # a whole footer: no cut
            assert manager.recovery_cuts == []
            assert read_all(manager) == pristine_completed[1]
        assert path.read_bytes() == intact
        return
    cut = expected_cut(damaged, footer_offset(), full_size())
    if written == 0:
        assert cut is None  # a blank footer: the chunk simply was never completed
    else:
        assert cut is not None and cut[0] == footer_offset() and cut[1] <= written
    recover(directory, pristine_completed[1], DATA_END, [cut] if cut else [])


def test_torn_footer_and_torn_data_together(
    pristine_completed: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine_completed[0], tmp_path / "store")
    path = last_file(directory)
    overwrite(path, footer_offset() + 30, bytes(FOOTER_SIZE - 30))
    start = boundaries()[6]
    flip_byte(path, data_offset(start + 20))
    damaged = path.read_bytes()
    data_cut = (data_offset(start), DATA_END - start - 2)  # the last suffix ends in 00 00
    footer_cut = expected_cut(damaged, footer_offset(), full_size())
    assert footer_cut is not None
    recover(directory, pristine_completed[1][:22], start, [data_cut, footer_cut])


def test_read_only_open_of_a_damaged_store_changes_nothing(
    pristine: tuple[Path, list[Record]], tmp_path: Path
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    flip_byte(path, data_offset(boundaries()[3] + 50))
    os.truncate(path, data_offset(DATA_END))
    before = snapshot(directory)
    with ChunkManager(directory, make_config(), read_only=True) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == pristine[1][:19]
    assert snapshot(directory) == before


MiB = 1 << 20
STEP = SCAN_STEP
assert 20 * MiB >= 4 * STEP  # the files below span several steps
SLOTS_PER_STEP = STEP // 12  # scan_fixed's step for 12-byte slots


@pytest.mark.parametrize(
    "marks", [[], [123], [124], [STEP - 1], [STEP], [123, 2 * STEP + 5], [20 * MiB - 1]]
)
def test_nonzero_extent_finds_the_last_non_zero_byte_across_steps(
    tmp_path: Path, marks: list[int]
) -> None:
    """The tail scan walks back a step (``SCAN_STEP``) at a time, releasing each all-zero step:
    the last non-zero byte is found wherever it lies against the steps' bounds."""
    path = tmp_path / "tail"
    with open(path, "wb") as f:
        f.write(bytes(20 * MiB))  # written zeros, not a hole: one data range of 20 MiB
        for mark in marks:
            f.seek(mark)
            f.write(b"\x01")
    start = 123
    fd = os.open(path, os.O_RDONLY)
    try:
        found = nonzero_extent(fd, start, 20 * MiB)
    finally:
        os.close(fd)
    assert found == (max(marks) + 1 if marks else start)


@pytest.mark.parametrize(
    "first_empty",
    [0, 1, SLOTS_PER_STEP - 1, SLOTS_PER_STEP, SLOTS_PER_STEP + 1, 700_000, None],
)
def test_scan_fixed_finds_the_first_empty_slot_across_steps(first_empty: int | None) -> None:
    """Fixed-size slots are searched a step (about ``SCAN_STEP``, slot-aligned) at a
    time: an empty slot is found wherever it lies against the steps' bounds (slot
    ``SLOTS_PER_STEP`` straddles the first ``SCAN_STEP`` bytes), and the zero runs
    that straddle two full slots, everywhere here, end nothing."""
    size, slots = 12, 900_000
    # A non-zero byte first, then one last: 22 zero bytes straddle each such pair.
    pair = b"\x07" + bytes(11) + bytes(11) + b"\x07"
    data = bytearray(pair * (slots // 2))
    if first_empty is not None:
        data[first_empty * size : (first_empty + 1) * size] = bytes(size)
    buf = bytes(HEADER_SIZE) + bytes(data)
    result = scan_fixed(buf, len(data), size)
    expected = slots if first_empty is None else first_empty
    assert (result.data_end, result.record_count) == (expected * size, expected)


# --- the tail hint (the checkpoint's record of where the ongoing chunk ended) ----------


def chunk_id_of(path: Path) -> uuid.UUID:
    with open(path, "rb") as f:
        return ChunkHeader.unpack(f.read(HEADER_SIZE)).chunk_id


def check_whole(manager: ChunkManager, records: list[Record]) -> None:
    """The store as a scan from the first record finds it, and a footer that agrees."""
    last = manager.last_chunk
    assert last is not None
    assert (last.data_end, last.record_count) == (DATA_END, len(LAST_SIZES))
    assert manager.recovery_cuts == []
    assert read_all(manager) == records
    ChunkWriter(manager).complete()
    assert last.footer is not None and last.footer.record_count == len(LAST_SIZES)


def test_without_a_tail_hint_the_scan_starts_at_the_first_record(
    pristine: tuple[Path, list[Record]], tmp_path: Path, scan_starts: list[int]
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    with ChunkManager(directory, make_config()) as manager:
        assert scan_starts == [0]
        check_whole(manager, pristine[1])


@pytest.mark.parametrize("index", range(1, len(LAST_SIZES) + 1))
def test_tail_hint_starts_the_scan_where_its_records_ended(
    pristine: tuple[Path, list[Record]], tmp_path: Path, scan_starts: list[int], index: int
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    hint = TailHint(chunk_id_of(last_file(directory)), boundaries()[index], index)
    with ChunkManager(directory, make_config(), tail_hint=hint) as manager:
        assert scan_starts == [boundaries()[index]]
        check_whole(manager, pristine[1])


def test_tail_hint_before_a_torn_tail_cuts_what_a_full_scan_cuts(
    pristine: tuple[Path, list[Record]], tmp_path: Path, scan_starts: list[int]
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    flip_byte(path, data_offset(boundaries()[6] + 4), 0x10)  # record 6's payload: torn
    damaged = path.read_bytes()
    cut = expected_cut(damaged, data_offset(boundaries()[6]), data_offset(SMALL))
    assert cut is not None
    with ChunkManager(
        directory, make_config(), tail_hint=TailHint(chunk_id_of(path), boundaries()[3], 3)
    ) as manager:
        assert scan_starts == [boundaries()[3]]
        check_cuts(directory, manager.recovery_cuts, damaged, [cut])
        assert read_all(manager) == pristine[1][: 16 + 6]
        last = manager.last_chunk
        assert last is not None and (last.data_end, last.record_count) == (boundaries()[6], 6)


REFUSED_HINTS = {
    "inside a record": (boundaries()[4] + 1, 4),
    "a byte short of a record's end": (boundaries()[4] - 1, 4),
    "in the zeros past the data": (DATA_END + 13, 9),
    "past the data area": (SMALL + 100, 9),
}


@pytest.mark.parametrize("name", REFUSED_HINTS)
def test_tail_hint_that_is_not_a_record_boundary_is_refused(
    pristine: tuple[Path, list[Record]],
    tmp_path: Path,
    scan_starts: list[int],
    caplog: pytest.LogCaptureFixture,
    name: str,
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    data_end, count = REFUSED_HINTS[name]
    with (
        caplog.at_level(logging.WARNING, logger="equeue.chunks"),
        ChunkManager(
            directory, make_config(), tail_hint=TailHint(chunk_id_of(path), data_end, count)
        ) as manager,
    ):
        assert scan_starts == [0]
        check_whole(manager, pristine[1])
    assert any(
        str(path) in r.getMessage() and str(data_end) in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("name", ["another chunk", "no records", "more records than fit"])
def test_tail_hint_about_something_else_is_not_used(
    pristine: tuple[Path, list[Record]], tmp_path: Path, scan_starts: list[int], name: str
) -> None:
    directory = copy_of(pristine[0], tmp_path / "store")
    chunk_id = chunk_id_of(last_file(directory))
    hint = {
        "another chunk": TailHint(uuid.uuid4(), boundaries()[4], 4),
        "no records": TailHint(chunk_id, boundaries()[4], 0),
        "more records than fit": TailHint(chunk_id, boundaries()[4], boundaries()[4]),
    }[name]
    with ChunkManager(directory, make_config(), tail_hint=hint) as manager:
        assert scan_starts == [0]
        check_whole(manager, pristine[1])


def test_damage_before_the_tail_hint_is_left_to_reads(
    pristine: tuple[Path, list[Record]], tmp_path: Path, scan_starts: list[int]
) -> None:
    # The records before the hint were durable when it was written: damage there is the
    # disk's, not a torn write. Recovery keeps every record after it (a scan from the
    # first record would cut them all); reading the damaged record is refused.
    directory = copy_of(pristine[0], tmp_path / "store")
    path = last_file(directory)
    flip_byte(path, data_offset(boundaries()[2] + 4 + LAST_SIZES[2] // 2), 0x10)
    with ChunkManager(
        directory, make_config(), tail_hint=TailHint(chunk_id_of(path), boundaries()[5], 5)
    ) as manager:
        assert scan_starts == [boundaries()[5]]
        assert manager.recovery_cuts == []
        assert manager.committed_position == LAST_START + DATA_END
        assert read_all(manager, LAST_START + boundaries()[3]) == pristine[1][16 + 3 :]
        with pytest.raises(CorruptionError, match="checksum") as info:
            read_all(manager, LAST_START + boundaries()[2])
        assert f"{path} at offset {data_offset(boundaries()[2])} " in str(info.value)
