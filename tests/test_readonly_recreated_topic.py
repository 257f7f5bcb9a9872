"""A read-only handle that mapped (or listed) topic x's queue chunk files before the
writer deleted x and made it again must not read the new topic's files as the old one's:
the new file under the old name is another chunk (the header's chunk id, written once
at creation, differs), so the read is TopicNotFoundError (the deletion explains it), never
the new topic's messages under the old queue offsets. Before (round 19's fixrace saw it):
``queue_positions`` + ``read`` and ``pull`` of offsets 0-2 returned new0..new2."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from store_helpers import killed_store

from equeue import MessageStore, StoreConfig
from equeue.errors import ChunkReplacedError, EQueueError, TopicNotFoundError, TruncatedError
from equeue.format.chunk import CHUNK_ID_OFFSET, HEADER_SIZE, ChunkHeader

RECORDS = 342  # entries a queue chunk (the least StoreConfig allows)
CONFIG = StoreConfig(flush="os", queue_chunk_records=RECORDS)
READ = 32  # entries read from offset 0
QUEUE_DIR = ("queues", "x", "0")


@contextlib.contextmanager
def _writer_and_view(
    path: Path, config: StoreConfig = CONFIG
) -> Iterator[tuple[MessageStore, MessageStore]]:
    """A writer of ``path`` and a read-only handle opened beside it."""
    with (
        MessageStore.open(path, config) as writer,
        MessageStore.open(path, read_only=True) as reader,
    ):
        yield writer, reader


@contextlib.contextmanager
def _recreated(path: Path, old: int, new: int) -> Iterator[tuple[MessageStore, MessageStore]]:
    """A writer and a read-only handle whose view of x's queue 0 holds ``old`` entries
    ("old0".."oldN"), its files then deleted and x made again with ``new`` entries."""
    with _writer_and_view(path) as (writer, reader):
        writer.create_topic("x", 1)
        for i in range(old):
            writer.send("x", b"old%d" % i)
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, old)
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(new):
            writer.send("x", b"new%d" % i)
        yield writer, reader


def _bodies_by_positions(reader: MessageStore, count: int) -> list[bytes]:
    return [reader.read(p).body for p in reader.queue_positions("x", 0, 0, count)]


def _bodies_by_pull(reader: MessageStore, count: int) -> list[bytes]:
    return [m.body for m in reader.pull("x", 0, 0, count).messages]


def _offset_for_time(reader: MessageStore, count: int) -> list[bytes]:
    offset = reader.offset_for_time("x", 0, 0)
    return [m.body for m in reader.pull("x", 0, offset, count).messages]


READS: dict[str, Callable[[MessageStore, int], list[bytes]]] = {
    "queue_positions": _bodies_by_positions,
    "pull": _bodies_by_pull,
    "offset_for_time": _offset_for_time,
}


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize(("old", "new"), [(3, 3), (3, 5), (400, 700)])
def test_a_view_of_a_topic_made_again_never_reads_the_new_files_as_its_own(
    tmp_path: Path, read: str, old: int, new: int
) -> None:
    # (400, 700): two queue chunks; the view's first, completed, is mapped by name.
    with _recreated(tmp_path / "s", old, new) as (_, reader):
        try:
            bodies = READS[read](reader, min(old, READ))
        except TopicNotFoundError as exc:
            assert "created again" in str(exc)
        else:
            pytest.fail(f"the deleted topic's view returned {bodies}")
        reader.refresh()
        count = min(new, READ)
        assert READS[read](reader, count) == [b"new%d" % i for i in range(count)]


def test_the_view_reads_its_own_chunk_mapped_before_the_deletion(tmp_path: Path) -> None:
    # The control: a chunk this view mapped before the deletion is the old topic's file
    # (unlinked, alive while mapped): its entries are read as they were, not refused.
    with (
        MessageStore.open(tmp_path / "s", CONFIG) as writer,
        MessageStore.open(tmp_path / "s", read_only=True) as reader,
    ):
        writer.create_topic("x", 1)
        sent = [writer.send("x", b"old%d" % i).position for i in range(3)]
        assert reader.queue_positions("x", 0, 0, 3) == sent  # (mapped now)
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(3):
            writer.send("x", b"new%d" % i)
        assert reader.queue_positions("x", 0, 0, 3) == sent


def _queue_file(store: Path, number: int = 0) -> Path:
    return store.joinpath(*QUEUE_DIR) / f"chunk-{number:012d}.0000"


def test_a_queue_file_replaced_by_hand_is_chunk_replaced_for_reader_and_writer(
    tmp_path: Path,
) -> None:
    # No deletion explains it: the error names the file, the id field and both ids. The
    # stand-in is a real chunk file (another store's, the same layout), its entries valid.
    other = tmp_path / "other"
    with MessageStore.open(other, CONFIG) as store:
        store.create_topic("x", 1)
        for i in range(400):
            store.send("x", b"theirs%d" % i)
    path = tmp_path / "s"
    with _writer_and_view(path) as (writer, reader):
        writer.create_topic("x", 1)
        for i in range(400):
            writer.send("x", b"ours%d" % i)
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, 400)
        for store in (writer, reader):
            store.queue_positions("x", 0, 390, 2)  # chunk 1 mapped: chunk 0 is not
        ours = ChunkHeader.unpack(_queue_file(path).read_bytes()[:HEADER_SIZE]).chunk_id
        theirs = _queue_file(other).read_bytes()
        temp = _queue_file(path).with_name("stand-in")
        temp.write_bytes(theirs)
        os.replace(temp, _queue_file(path))
        for store in (reader, writer):
            with pytest.raises(ChunkReplacedError, match="not the chunk") as info:
                store.queue_positions("x", 0, 0, 2)
            assert info.value.file == str(_queue_file(path))
            assert info.value.offset == CHUNK_ID_OFFSET
            assert str(ours) in str(info.value)
        assert "x" in reader.topics()


@pytest.mark.parametrize("new", [6, RECORDS + 58])
def test_a_view_whose_tail_file_was_replaced_keeps_its_own_end(tmp_path: Path, new: int) -> None:
    # The view's last chunk, ongoing and mapped when it was read: its refresh rescans the
    # file under its name (6: the new topic's chunk still ongoing) or reads its footer
    # (400: completed). Before: the view took the new file's end for its own (3 -> 6, or
    # 3 -> 342, its entries past 3 then read from the old mapping as zero).
    with (
        MessageStore.open(tmp_path / "s", CONFIG) as writer,
        MessageStore.open(tmp_path / "s", read_only=True) as reader,
    ):
        writer.create_topic("x", 1)
        for i in range(3):
            writer.send("x", b"old%d" % i)
        assert len(reader.queue_positions("x", 0, 0, 3)) == 3  # (mapped now)
        queue = reader._queues["x"][0]
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(new):
            writer.send("x", b"new%d" % i)
        with pytest.raises(ChunkReplacedError):
            queue.refresh()
        assert (queue.first_offset, queue.next_offset) == (0, 3)
        with pytest.raises(TopicNotFoundError):
            reader.pull("x", 0, 3, 10, wait=0.05)
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, new)


WRITER = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(flush="os", queue_chunk_records=342))
store.delete_topic("x")
store.create_topic("x", 1)
for i in range(700):
    store.send("x", b"new%d" % i)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_view_of_a_topic_made_again_by_a_writer_killed_after(tmp_path: Path) -> None:
    # Two processes: the writer (another process) deletes x, makes it again, sends 700
    # and is SIGKILLed; the reader's view (400 entries, 2 chunks) reads nothing of the new x
    # as the old one's, before and after the next writable open's recovery.
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("x", 1)
        for i in range(400):
            store.send("x", b"old%d" % i)
    with MessageStore.open(path, read_only=True) as reader:
        assert reader.queue_range("x", 0) == (0, 400)
        killed_store(WRITER, path)
        with pytest.raises(TopicNotFoundError):
            _bodies_by_positions(reader, READ)
        reader.refresh()
        expected = [b"new%d" % i for i in range(READ)]
        for read in READS.values():
            assert read(reader, READ) == expected
    with MessageStore.open(path, CONFIG) as writer:
        assert writer.recovery.problems == []
        assert _bodies_by_pull(writer, READ) == expected


def test_a_queue_file_deleted_or_truncated_under_the_view_is_an_equeue_error(
    tmp_path: Path,
) -> None:
    # Chunk 0 cut short by hand, chunk 1 (older files still listed: not retention's)
    # deleted; the view had mapped only its last chunk. (The oldest chunk deleted by hand
    # reads as retention's removal for a view, which cannot tell them apart: left so.)
    path = tmp_path / "s"
    with _writer_and_view(path) as (writer, reader):
        writer.create_topic("x", 1)
        for i in range(3 * RECORDS + 50):
            writer.send("x", b"m%d" % i)
        writer.flush()
        reader.refresh()
        reader.queue_positions("x", 0, 3 * RECORDS + 40, 2)  # the last chunk mapped only
        with _queue_file(path, 0).open("r+b") as f:
            f.truncate(HEADER_SIZE // 2)
        _queue_file(path, 1).unlink()
        for offset in (0, RECORDS + 10):
            with pytest.raises(EQueueError) as info:
                reader.queue_positions("x", 0, offset, 2)
            assert not isinstance(info.value, TopicNotFoundError)
            with pytest.raises(EQueueError) as info:
                reader.pull("x", 0, offset, 2)
            assert not isinstance(info.value, TopicNotFoundError)
        with pytest.raises(EQueueError) as info:
            reader.offset_for_time("x", 0, time.time() + 60)
        assert not isinstance(info.value, TopicNotFoundError)


@pytest.mark.parametrize(("old", "new"), [(3, 5), (400, 700), (400, 5 * RECORDS)])
def test_a_view_whose_queue_files_were_closed_meanwhile_never_reads_the_new_ones(
    tmp_path: Path, old: int, new: int
) -> None:
    # The handle's cache of open queues closed x's queue (as it does past
    # StoreConfig.max_open_files' share): opened again, a new ChunkManager lists the
    # directory, the new topic's files. Before: new0..new2 under offsets 0-2, the range
    # (0, new). (400, 1710): the new files reach past the view's last chunk.
    with (
        MessageStore.open(tmp_path / "s", CONFIG) as writer,
        MessageStore.open(tmp_path / "s", read_only=True) as reader,
    ):
        writer.create_topic("x", 1)
        for i in range(old):
            writer.send("x", b"old%d" % i)
        assert _bodies_by_positions(reader, 3) == [b"old0", b"old1", b"old2"]
        reader._files.close_idle()
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(new):
            writer.send("x", b"new%d" % i)
        with pytest.raises(TopicNotFoundError, match="created again"):
            _bodies_by_positions(reader, 3)
        reader.refresh()
        assert _bodies_by_positions(reader, 3) == [b"new0", b"new1", b"new2"]
        assert reader.queue_range("x", 0) == (0, new)


def test_a_replaced_queue_file_is_reported_once_then_read_anew(tmp_path: Path) -> None:
    # No deletion explains it (a writer's open that set damaged queue files aside and
    # rebuilt them makes the same sight): ChunkReplacedError once, and the next read
    # opens the queue's files as they are, as a new handle would, not the error for ever.
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as writer:
        writer.create_topic("x", 1)
        sent = [writer.send("x", b"m%d" % i).position for i in range(3)]
    with MessageStore.open(path, read_only=True) as reader:
        assert reader.queue_positions("x", 0, 0, 3) == sent
        reader._files.close_idle()
        stand_in = _queue_file(path).with_name("stand-in")
        stand_in.write_bytes(_queue_file(path).read_bytes())
        header = ChunkHeader.unpack(stand_in.read_bytes()[:HEADER_SIZE])
        with stand_in.open("r+b") as f:
            f.write(_with_id(header, uuid.uuid4()).pack())
        os.replace(stand_in, _queue_file(path))
        with pytest.raises(ChunkReplacedError, match=str(header.chunk_id)):
            reader.queue_positions("x", 0, 0, 3)
        assert reader.queue_positions("x", 0, 0, 3) == sent


def test_refresh_beside_a_replaced_tail_file(tmp_path: Path) -> None:
    # refresh() of a handle whose view of x's last chunk (ongoing, mapped) was replaced:
    # made again by the writer, refresh() drops the old x and opens the new one; replaced
    # by hand (no deletion), refresh() succeeds and the queue is read from its files anew.
    path = tmp_path / "s"
    with _writer_and_view(path) as (writer, reader):
        writer.create_topic("x", 1)
        writer.create_topic("y", 1)
        for i in range(3):
            writer.send("x", b"old%d" % i)
            writer.send("y", b"y%d" % i)
        writer.flush()
        assert len(reader.queue_positions("x", 0, 0, 3)) == 3
        assert len(reader.queue_positions("y", 0, 0, 3)) == 3
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(5):
            writer.send("x", b"new%d" % i)
        follow = reader._queues["x"][0]
        with pytest.raises(ChunkReplacedError):
            follow.refresh()  # (what refresh() meets inside, once topics.json was read)
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, 5)
        y_file = path / "queues" / "y" / "0" / "chunk-000000000000.0000"
        stand_in = y_file.with_name("stand-in")
        stand_in.write_bytes(y_file.read_bytes())
        header = ChunkHeader.unpack(stand_in.read_bytes()[:HEADER_SIZE])
        with stand_in.open("r+b") as f:
            f.write(_with_id(header, uuid.uuid4()).pack())
        os.replace(stand_in, y_file)  # (the same entries, under another chunk id)
        reader.refresh()
        reader.refresh()  # (not the error at every refresh)
        assert [reader.read(p).body for p in reader.queue_positions("y", 0, 0, 3)] == [
            b"y0",
            b"y1",
            b"y2",
        ]


def _with_id(header: ChunkHeader, chunk_id: uuid.UUID) -> ChunkHeader:
    return ChunkHeader(
        chunk_type=header.chunk_type,
        chunk_start_number=header.chunk_start_number,
        chunk_end_number=header.chunk_end_number,
        chunk_data_size=header.chunk_data_size,
        chunk_id=chunk_id,
        record_size=header.record_size,
        created_at_ns=header.created_at_ns + 1,
    )


# review16 R16-1: a look (every read-only read, when retention removed the log's first
# chunk) catches up every open queue; x's replaced files must neither fail a read of y
# nor be forgotten, so x's next read is TopicNotFoundError, never the new x's bodies.
RETAIN = dt.timedelta(hours=1)


@pytest.mark.parametrize("first_read", ["pull", "read"])
def test_retention_underneath_a_look_neither_fails_another_topic_nor_passes_new_files(
    tmp_path: Path, first_read: str
) -> None:
    config = StoreConfig(
        flush="os", chunk_data_size=4096, retention=RETAIN, queue_chunk_records=RECORDS
    )
    path = tmp_path / "s"
    with _writer_and_view(path, config) as (writer, reader):
        writer.create_topic("x", 1)
        writer.create_topic("y", 1)
        y_last = 0
        for i in range(100):
            y_last = writer.send("y", b"y%d" % i).position
        for i in range(3):
            writer.send("x", b"old%d" % i)
        writer.flush()
        reader.refresh()
        assert [m.body for m in reader.pull("x", 0, 0, 3).messages] == [b"old0", b"old1", b"old2"]
        reader.pull("y", 0, 0, 3)
        writer.delete_topic("x")
        writer.create_topic("x", 1)
        for i in range(5):
            writer.send("x", b"new%d" % i)
        first = next(iter(writer._messages)).footer
        assert first is not None and first.last_timestamp is not None
        removed = writer.apply_retention(
            now=first.last_timestamp / 1e9 + RETAIN.total_seconds() + 1e-6
        )
        assert removed, "retention removed no log chunk: the look would not follow"
        time.sleep(0.02)  # past the handle's look interval (follow._LOOK_EVERY)
        if first_read == "pull":
            assert [m.body for m in reader.pull("y", 0, 90, 3).messages] == [b"y90", b"y91", b"y92"]
        else:
            assert reader.read(y_last).body == b"y99"
        with pytest.raises(TopicNotFoundError):
            reader.pull("x", 0, 0, 3)
        # Read anew after the deletion is seen: the new topic's own messages.
        assert [m.body for m in reader.pull("x", 0, 0, 5).messages] == [
            b"new%d" % i for i in range(5)
        ]


def test_a_tail_file_cut_inside_its_header_is_truncated_not_replaced(tmp_path: Path) -> None:
    # (review16: the tail's rescan said "deleted and a new file made under its name" of a
    # file cut short by hand, its chunk id not all there)
    path = tmp_path / "s"
    with _writer_and_view(path) as (writer, reader):
        writer.create_topic("x", 1)
        for i in range(10):
            writer.send("x", b"m%d" % i)
        writer.flush()
        reader.refresh()
        assert reader.queue_range("x", 0) == (0, 10)
        with _queue_file(path, 0).open("r+b") as f:
            f.truncate(CHUNK_ID_OFFSET + 4)
        with pytest.raises(TruncatedError) as info:
            reader.refresh()
        assert info.value.file == str(_queue_file(path, 0))
