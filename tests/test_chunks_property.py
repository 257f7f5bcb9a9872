"""Property and stateful tests of the chunk engine against an in-memory model."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import xxhash
from chunk_helpers import Record, chunk_files, frame_size, make_config, payload, read_all
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from equeue.chunks import ChunkFooter, ChunkManager, ChunkReader, ChunkWriter
from equeue.format.chunk import FOOTER_SIZE, FRAME_OVERHEAD, HEADER_SIZE

CHUNK_SIZES = st.sampled_from([4096, 8192, 16384])


def place(committed: int, chunk_data_size: int, record: bytes) -> int:
    """Where the model expects the next record: at the committed end if it fits the
    chunk there, else at the start of the next chunk."""
    if committed % chunk_data_size + frame_size(record) > chunk_data_size:
        return (committed // chunk_data_size + 1) * chunk_data_size
    return committed


def check_store(directory: Path, chunk_data_size: int, model: list[Record]) -> None:
    """Reopen and compare everything with the model, including completed footers."""
    with ChunkManager(directory, make_config(chunk_data_size)) as manager:
        assert manager.recovery_cuts == []
        assert read_all(manager) == model
        chunks = list(manager)
    files = chunk_files(directory)
    assert [c.path for c in chunks] == files
    for chunk in chunks[:-1]:
        raw = chunk.path.read_bytes()
        footer = ChunkFooter.unpack(raw[-FOOTER_SIZE:])
        mine = [r for p, r in model if p // chunk_data_size == chunk.start_number]
        assert footer.record_count == len(mine)
        assert footer.physical_data_size == sum(map(frame_size, mine))
        physical = footer.physical_data_size
        assert footer.checksum == xxhash.xxh3_64_intdigest(raw[: HEADER_SIZE + physical])


@settings(max_examples=100, deadline=None)
@given(
    chunk_data_size=CHUNK_SIZES,
    sizes=st.lists(
        st.integers(1, 300) | st.integers(1, 16384 - FRAME_OVERHEAD), min_size=1, max_size=30
    ),
    reopen_every=st.integers(1, 30),
)
def test_records_land_where_the_model_says_and_read_back(
    chunk_data_size: int, sizes: list[int], reopen_every: int
) -> None:
    sizes = [min(size, chunk_data_size - FRAME_OVERHEAD) for size in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model: list[Record] = []
        committed = 0
        manager = ChunkManager(directory, make_config(chunk_data_size))
        try:
            writer = ChunkWriter(manager)
            for i, size in enumerate(sizes):
                if i and i % reopen_every == 0:
                    manager.close()
                    manager = ChunkManager(directory, make_config(chunk_data_size))
                    writer = ChunkWriter(manager)
                record = payload(i, size)
                expected = place(committed, chunk_data_size, record)
                assert writer.write(record) == expected
                model.append((expected, record))
                committed = expected + frame_size(record)
                assert manager.committed_position == committed
        finally:
            manager.close()
        check_store(directory, chunk_data_size, model)


def mostly_zero_record(rng: random.Random) -> bytes:
    raw = bytearray(rng.choice(b"\0\0\0\x01\xff") for _ in range(16))
    if not any(raw):
        raw[rng.randrange(16)] = 1
    return bytes(raw)


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 600), seed=st.integers(0, 1 << 32), data=st.data())
def test_fixed_size_records_reopen_and_iterate(count: int, seed: int, data: st.DataObject) -> None:
    rng = random.Random(seed)
    records = [mostly_zero_record(rng) for _ in range(count)]
    start = data.draw(st.integers(0, 16 * count + 16), label="start")
    # Mostly-zero records: zero runs straddle slots, yet reopening finds the exact end.
    config = make_config(4096, record_size=16)
    model = [(i * 16, record) for i, record in enumerate(records)]
    with tempfile.TemporaryDirectory() as tmp:
        with ChunkManager(tmp, config) as manager:
            assert ChunkWriter(manager).write_many(records) == [p for p, _ in model]
        with ChunkManager(tmp, config) as manager:
            assert manager.recovery_cuts == []
            assert manager.committed_position == 16 * len(records)
            assert read_all(manager) == model
            got = list(ChunkReader(manager).iter_from(start))
            assert got == [(p, r) for p, r in model if p >= start]


class ChunkStoreMachine(RuleBasedStateMachine):
    """The store must always agree with a list of (position, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="equeue-stateful-"))
        self.chunk_data_size = 4096
        self.model: list[Record] = []
        self.seed = 0
        self.manager: ChunkManager | None = None
        self.writer: ChunkWriter | None = None

    @initialize(chunk_data_size=CHUNK_SIZES)
    def open_store(self, chunk_data_size: int) -> None:
        self.chunk_data_size = chunk_data_size
        self._open()

    def _open(self) -> None:
        self.manager = ChunkManager(self.directory, make_config(self.chunk_data_size))
        self.writer = ChunkWriter(self.manager)

    @property
    def committed(self) -> int:
        if not self.model:
            return 0
        position, record = self.model[-1]
        return position + frame_size(record)

    def _size(self, kind: str, small: int) -> int:
        cds = self.chunk_data_size
        room = cds - self.committed % cds - FRAME_OVERHEAD  # largest record that still fits
        largest = cds - FRAME_OVERHEAD
        return {
            "small": small,
            "exact": room if room >= 1 else small,
            "over": room + 1 if 1 <= room < largest else small,
            "near-chunk": largest - small % 8,
        }[kind]

    def _payload(self, size: int) -> bytes:
        self.seed += 1
        return payload(self.seed, size)

    def _write(self, records: list[bytes], positions: list[int]) -> None:
        for record, position in zip(records, positions, strict=True):
            expected = place(self.committed, self.chunk_data_size, record)
            assert position == expected, f"{len(record)}-byte record at {position}"
            self.model.append((position, record))

    @rule(
        kind=st.sampled_from(["small", "small", "exact", "over", "near-chunk"]),
        small=st.integers(1, 600),
    )
    def write(self, kind: str, small: int) -> None:
        assert self.writer is not None
        record = self._payload(self._size(kind, small))
        self._write([record], [self.writer.write(record)])

    @rule(smalls=st.lists(st.integers(1, 1500), min_size=1, max_size=6))
    def write_many(self, smalls: list[int]) -> None:
        assert self.writer is not None
        records = [self._payload(size) for size in smalls]
        self._write(records, self.writer.write_many(records))

    @rule()
    def reopen(self) -> None:
        assert self.manager is not None
        self.manager.close()
        self._open()
        assert self.manager.recovery_cuts == []
        assert self.manager.committed_position == self.committed

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def read_known_position(self, data: st.DataObject) -> None:
        assert self.manager is not None
        position, record = data.draw(st.sampled_from(self.model))
        assert ChunkReader(self.manager).read(position) == record

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def iter_from_known_position(self, data: st.DataObject) -> None:
        assert self.manager is not None
        index = data.draw(st.integers(0, len(self.model) - 1))
        got = list(ChunkReader(self.manager).iter_from(self.model[index][0]))
        assert got == self.model[index:]

    @invariant()
    def store_matches_model(self) -> None:
        manager = self.manager
        if manager is None:
            return
        assert manager.committed_position == self.committed
        assert read_all(manager) == self.model
        reader = ChunkReader(manager)
        previous = -1
        for position, record in self.model:
            assert position > previous
            previous = position
            chunk = manager.get_chunk_for(position)
            assert chunk.start_number == position // self.chunk_data_size
            assert reader.read(position) == record

    def teardown(self) -> None:
        try:
            if self.manager is not None:
                self.manager.close()
                check_store(self.directory, self.chunk_data_size, self.model)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


ChunkStoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
TestChunkStore = ChunkStoreMachine.TestCase
