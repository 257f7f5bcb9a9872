"""A damaged position map of a compacted chunk is corruption, never a removal (review f
F1): one flipped byte made a live record read as "removed by compaction", and a pull
skipped it without an error.

The compacted chunk is written by the rewrite itself (no Spark): chunks 0..2 of a plain
topic, every third record removed, installed by hand as a job would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import compact_by_hand

from equeue import MessageStore, StoreConfig
from equeue.errors import CompactedAwayError, CorruptionError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, MAP_ENTRY, MAP_ENTRY_SIZE, ChunkFooter
from equeue.inspect.layout import load_chunk_file
from equeue.inspect.verify import verify_store

CONFIG = StoreConfig(chunk_data_size=8 * 1024, flush="os")
TOPIC = "d"


def _compacted_store(path: Path) -> tuple[Path, list[int], set[int]]:
    """(the compacted file, the positions it keeps, the positions it removed)."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic(TOPIC, 1)
        for i in range(400):
            store.send(TOPIC, b"plain %d " % i + b"x" * (i % 50))
    compacted = compact_by_hand(path, 3, lambda positions: set(positions[::3]))
    assert verify_store(path) == []
    return compacted


def _map_at(file: Path) -> tuple[int, int]:
    """(file offset of the map, its entry count)."""
    raw = file.read_bytes()
    footer = ChunkFooter.unpack(raw[-FOOTER_SIZE:])
    return HEADER_SIZE + footer.physical_data_size, footer.map_entry_count


def _entry(file: Path, index: int) -> tuple[int, int]:
    at, _ = _map_at(file)
    with file.open("rb") as f:
        f.seek(at + index * MAP_ENTRY_SIZE)
        logical, physical = MAP_ENTRY.unpack(f.read(MAP_ENTRY_SIZE))
    return int(logical), int(physical)


def _set_entry(file: Path, index: int, logical: int, physical: int) -> int:
    at, _ = _map_at(file)
    with file.open("r+b") as f:
        f.seek(at + index * MAP_ENTRY_SIZE)
        f.write(MAP_ENTRY.pack(logical, physical))
    return at + index * MAP_ENTRY_SIZE


def _pull_all(store: MessageStore) -> list[int]:
    return [m.position for m in store.pull(TOPIC, 0, 0, 1000)]


def test_the_undamaged_compacted_store_reads_survivors_and_reports_removals(
    tmp_path: Path,
) -> None:
    _, kept, removed = _compacted_store(tmp_path)
    with MessageStore.open(tmp_path, read_only=True) as store:
        assert [p for p in _pull_all(store) if p < max(kept) + 1] == kept
        with pytest.raises(CompactedAwayError):
            store.read(min(removed))


@pytest.mark.parametrize("read_only", [True, False])
def test_a_flipped_byte_out_of_order_in_the_map_is_corruption(
    tmp_path: Path, read_only: bool
) -> None:
    """The reviewer's flip: byte 13 of the map (entry 1's logical offset)."""
    file, kept, _ = _compacted_store(tmp_path)
    at, _ = _map_at(file)
    with file.open("r+b") as f:
        f.seek(at + 13)
        byte = f.read(1)[0]
        f.seek(at + 13)
        f.write(bytes([byte ^ 0x5A]))
    damaged = file.read_bytes()
    with MessageStore.open(tmp_path, read_only=read_only) as store:
        with pytest.raises(CorruptionError) as caught:
            _pull_all(store)
        assert not isinstance(caught.value, CompactedAwayError)
        assert str(file) in str(caught.value) and "position map entry 1 " in str(caught.value)
        assert caught.value.offset == at + MAP_ENTRY_SIZE
        for position in kept[:3]:  # entry 1's record and its neighbours
            with pytest.raises(CorruptionError):
                store.read(position)
    assert file.read_bytes() == damaged


def test_a_map_entry_moved_within_its_gap_is_corruption(tmp_path: Path) -> None:
    """A logical offset off by one that still fits the map's order and gaps: the record's
    own position falls in a gap (it read as removed) and the shifted one leads to a
    record naming another position."""
    file, kept, removed = _compacted_store(tmp_path)
    # An entry with a removed record just before it: moving it back stays in order.
    index = next(
        i
        for i, p in enumerate(kept)
        if i > 0 and p - 1 not in kept and any(kept[i - 1] < r < p for r in removed)
    )
    logical, physical = _entry(file, index)
    entry_at = _set_entry(file, index, logical - 1, physical)
    position = kept[index]
    with MessageStore.open(tmp_path, read_only=True) as store:
        for read in (position, position - 1):
            with pytest.raises(CorruptionError) as caught:
                store.read(read)
            assert not isinstance(caught.value, CompactedAwayError)
            assert caught.value.offset == entry_at, read
            assert str(file) in str(caught.value)
        with pytest.raises(CorruptionError):
            _pull_all(store)


def test_a_physical_offset_moved_within_the_data_is_corruption(tmp_path: Path) -> None:
    """An entry's physical offset one byte off, still ascending: the removed position
    in the gap before it must not read as removed, nor its own as a record."""
    file, kept, removed = _compacted_store(tmp_path)
    index = next(
        i for i, p in enumerate(kept) if i > 0 and any(kept[i - 1] < r < p for r in removed)
    )
    logical, physical = _entry(file, index)
    _set_entry(file, index, logical, physical + 1)
    gap = min(r for r in removed if kept[index - 1] < r < kept[index])
    with MessageStore.open(tmp_path, read_only=True) as store:
        with pytest.raises(CorruptionError) as caught:
            store.read(gap)
        assert not isinstance(caught.value, CompactedAwayError)
        assert str(file) in str(caught.value)
        # The survivor's own entry leads to no valid frame: the pull says so (read() of
        # a position whose frame is invalid says "no message at position", as ever).
        with pytest.raises(CorruptionError) as caught:
            _pull_all(store)
        assert str(file) in str(caught.value)


def test_a_damaged_footer_of_a_compacted_chunk_is_reported_once_not_as_frames(
    tmp_path: Path,
) -> None:
    """verify walked the compacted chunk as if its logical offsets were physical: ~2000
    derived problems buried the footer's; inspect called the chunk "ongoing" (review f
    F2). Now: the footer problem, and one problem per run of queue entries into it."""
    file, _, _ = _compacted_store(tmp_path)
    at = file.stat().st_size - FOOTER_SIZE + 20
    with file.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))
    problems = verify_store(tmp_path)
    assert [(p.file, p.kind) for p in problems if p.kind != "queue entry"] == [
        (str(file), "footer")
    ]
    entries = [p for p in problems if p.kind == "queue entry"]
    assert len(entries) == 1 and "whose footer is damaged" in entries[0].reason
    assert file.name in entries[0].reason
    assert load_chunk_file(file, last=False).state == "damaged"
