"""A read-only handle whose topic the writer deletes (and makes again) under its
``refresh()`` or its pull (reviewl M2, M3; every ``delete_group`` deletes a retry
topic): the topic is seen whole or gone, the error is ``TopicNotFoundError``, never a
builtin ``FileNotFoundError``, nor a ``CorruptRecordError``/``ChunkRemovedError`` for a
healthy store: a pull made exact (the reader's queue ends past the new topic's file),
and a writer process deleting in a loop beside a refreshing, consuming reader, and beside
one calling ``offset_for_time`` and ``queue_positions`` + ``read`` (review7 F2)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig
from equeue.errors import CorruptRecordError, TopicNotFoundError
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE

CONFIG = StoreConfig(flush="os")
ROUNDS, DEADLINE_S = 100, 20.0


@contextlib.contextmanager
def _writer_and_reader(path: Path, tag: str = "") -> Iterator[tuple[MessageStore, ...]]:
    """A writer and a read-only handle of a store whose topic x (1 queue) holds 3
    messages ("old0".."old2")."""
    with (
        MessageStore.open(path, CONFIG) as writer,
        MessageStore.open(path, read_only=True) as reader,
    ):
        writer.create_topic("x", 1)
        for i in range(3):
            writer.send("x", b"old%d" % i, tag=tag)
        yield writer, reader


def test_a_pull_of_a_topic_deleted_and_made_again_under_it_is_topic_not_found(
    tmp_path: Path,
) -> None:
    with _writer_and_reader(tmp_path / "s") as (writer, reader):
        assert len(reader.pull("x", 0, 0, 10).messages) == 3
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(5):
            writer.send("x", b"new%d" % i)
        # the reader's queue ends at 3 (the old topic's), the file is the new topic's
        with pytest.raises(TopicNotFoundError, match=r"deleted .* created again"):
            reader.pull("x", 0, 3, 10, wait=0.1)
        reader.refresh()
        assert [m.body for m in reader.pull("x", 0, 0, 10).messages][:1] == [b"new0"]


def test_queue_positions_of_a_view_whose_topic_was_made_again_is_topic_not_found(
    tmp_path: Path,
) -> None:
    # The reader's queue (the old topic's, 3 entries, no chunk mapped yet) maps its chunk
    # by name and finds the new topic's file, 1 entry written: entries 1 and 2 read as
    # zero. Before (round 19's fixrace): CorruptRecordError "queue x/0 entry for offset 1
    # names position -1", on every run (a full suite's run saw it once, at offset 0).
    with _writer_and_reader(tmp_path / "s") as (writer, reader):
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, 3)
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        new = writer.send("x", b"new0").position
        with pytest.raises(TopicNotFoundError, match=r"deleted .* created again"):
            reader.queue_positions("x", 0, 0, 3)
        assert reader.queue_positions("x", 0, 0, 3) == [new]  # the queue, opened anew


def test_a_zero_entry_of_a_topic_not_deleted_is_still_damage(tmp_path: Path) -> None:
    # The control: the same zero (stored value 0, "position -1") in a queue whose topic
    # was neither deleted nor made again, beside its running writer, is damage for the
    # read-only handle (after its looks again), as for the writer.
    # A tag: the slot of the zeroed position is not all zero, so the scan counts it.
    with _writer_and_reader(tmp_path / "s", tag="t") as (writer, reader):
        writer.flush()
        reader.refresh()
        file = tmp_path / "s" / "queues" / "x" / "0" / "chunk-000000000000.0000"
        with file.open("r+b") as f:
            f.seek(HEADER_SIZE + QUEUE_RECORD_SIZE)  # offset 1's stored value
            f.write(bytes(8))
        for store in (reader, writer):
            with pytest.raises(CorruptRecordError, match=r"offset 1 names position -1") as info:
                store.queue_positions("x", 0, 0, 3)
            assert info.value.file == str(file)
            assert info.value.offset == HEADER_SIZE + QUEUE_RECORD_SIZE
            with pytest.raises(CorruptRecordError, match=r"offset 1 names position -1"):
                store.offset_for_time("x", 0, 0)
        assert "x" in reader.topics()


WRITER = """
import sys, time
from equeue import MessageStore, StoreConfig
rounds_max, deadline_s = int(sys.argv[2]), float(sys.argv[3])
sends, size = int(sys.argv[4]), int(sys.argv[5])
store = MessageStore.open(sys.argv[1], StoreConfig(flush="os", chunk_data_size=1 << 20))
started, rounds = time.monotonic(), 0
while rounds < rounds_max and time.monotonic() - started < deadline_s:
    store.delete_topic("x")
    store.create_topic("x", 2)
    for i in range(sends):
        store.send("x", b"m" * size, queue_id=i % 2)
    rounds += 1
store.close()
print(rounds)
"""

Read = Callable[[MessageStore, int], None]


def _errors_beside_a_deleting_writer(
    path: Path, rounds: int, deadline_s: float, sends: int, size: int, reads: list[Read]
) -> dict[str, int]:
    """Each of ``reads`` (after a refresh) in a loop while a writer process deletes,
    re-creates and fills topic x: every error other than TopicNotFoundError, counted."""
    with MessageStore.open(path, StoreConfig(flush="os", chunk_data_size=1 << 20)) as store:
        store.create_topic("x", 2)
        store.send("x", b"first")
    args = [str(path), str(rounds), str(deadline_s), str(sends), str(size)]
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, *args], stdout=subprocess.PIPE, text=True
    )
    errors: dict[str, int] = {}
    count = 0
    try:
        with MessageStore.open(path, read_only=True) as reader:
            deadline = time.monotonic() + deadline_s + 10
            while writer.poll() is None and time.monotonic() < deadline:
                count += 1
                for read in reads:
                    try:
                        reader.refresh()
                        read(reader, count % 2)
                    except TopicNotFoundError:
                        pass
                    except Exception as exc:  # every other class is counted
                        name = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
                        errors[name] = errors.get(name, 0) + 1
    finally:
        out: Any = writer.communicate(timeout=60)[0]
    assert writer.returncode == 0 and int(out) > 0
    assert count > 10
    return errors


def _range_and_consume(reader: MessageStore, queue_id: int) -> None:
    if "x" in reader.topics():
        reader.queue_range("x", queue_id)
    with reader.consumer("c", "x", timeout=0.02, auto_commit=False) as consumer:
        for _ in consumer:
            pass


def test_a_reader_beside_a_writer_deleting_its_topic_gets_only_topic_not_found(
    tmp_path: Path,
) -> None:
    reads: list[Read] = [_range_and_consume]
    assert _errors_beside_a_deleting_writer(tmp_path / "s", ROUNDS, DEADLINE_S, 5, 1, reads) == {}


def _offset_for_time(reader: MessageStore, queue_id: int) -> None:
    reader.offset_for_time("x", queue_id, time.time() - 1)


def _positions_read(reader: MessageStore, queue_id: int) -> None:
    for position in reader.queue_positions("x", queue_id, 0, 3):
        reader.read(position)


def test_offset_for_time_and_queue_positions_beside_a_writer_deleting_the_topic(
    tmp_path: Path,
) -> None:
    # Before (review7 F2): 24-29 of each in ~590 rounds, PositionNotFoundError "position
    # -1 is negative" and ChunkRemovedError of the deleted topic's index.
    reads: list[Read] = [_offset_for_time, _positions_read]
    assert _errors_beside_a_deleting_writer(tmp_path / "s", 600, 8.0, 40, 30000, reads) == {}
