"""Read-only handles beside a writer in another process that runs, closes, is killed or
applies retention; and every call on a closed store (issue 20, items 4 to 6)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pytest
from readonly_writer import body, key_for
from store_helpers import pull_all, snapshot

from equeue import Message, MessageStore, StoreConfig
from equeue.chunks.reader import ChunkReader
from equeue.cli import main
from equeue.compaction.job import compact
from equeue.errors import ChunkRemovedError, ClosedError, ReadOnlyError
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.store.meta import KEYS_FILE

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

WRITER = Path(__file__).with_name("readonly_writer.py")
SMALL: dict[str, Any] = {"chunk_data_size": MIN_CHUNK_DATA_SIZE, "queue_chunk_records": 342}


class Writer:
    """tests/readonly_writer.py in a subprocess."""

    def __init__(self, path: Path, cleanup: str = "delete", **config: Any) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WRITER), str(path), json.dumps(config), cleanup],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def start(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def answer(self) -> Any:
        assert self.process.stdout is not None
        reply = self.process.stdout.readline()
        assert reply.startswith("ok "), f"the writer failed: {reply!r}"
        return json.loads(reply[3:])

    def __call__(self, line: str) -> Any:
        self.start(line)
        return self.answer()

    def close(self) -> None:
        self("close")
        assert self.process.wait(30) == 0

    def kill(self) -> None:
        self.process.kill()  # SIGKILL
        self.process.wait(30)


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for writer in started:
        if writer.process.poll() is None:
            writer.kill()


def bodies(messages: list[Message]) -> list[bytes]:
    return [m.body for m in messages]


def sent(offsets: list[int], queue_id: int = 0) -> list[bytes]:
    return [body("t", queue_id, offset) for offset in offsets]


# --- item 4: the key index ----------------------------------------------------------


@pytest.mark.parametrize("shm", ["kept", "deleted"])
def test_read_only_open_after_a_killed_writer_sees_every_key(
    tmp_path: Path, writers: list[Writer], shm: str
) -> None:
    """Keys in the killed writer's WAL only (even the tables are there: the store is
    new), and one sent after its last flush (in the log only). Without the -shm SQLite
    cannot read the WAL without writing: the keys come from the log."""
    path = tmp_path / "s"
    writer = Writer(path, **SMALL)
    writers.append(writer)
    writer("send t 0 1 K")  # offset 0
    writer("flush")
    writer("send t 0 1 K")  # offset 1
    writer("send t 0 3")  # 2..4, no key
    writer("flush")
    writer("send t 0 1 K")  # offset 5: not yet in the index
    writer.kill()
    if shm == "deleted":
        (path / (KEYS_FILE + "-shm")).unlink()
    assert (path / (KEYS_FILE + "-wal")).stat().st_size > 0
    before = snapshot(path, skip=())
    with MessageStore.open(path, read_only=True) as reader:
        assert bodies(reader.query_by_key("t", "K")) == sent([5, 1, 0])
        assert bodies(reader.query_by_key("t", "K", limit=2)) == sent([5, 1])
        assert reader.query_by_key("t", "other") == []
        reader.refresh()
        assert bodies(reader.query_by_key("t", "K")) == sent([5, 1, 0])
    assert snapshot(path, skip=()) == before
    with MessageStore.open(path) as recovered:  # the control: what the writer sees
        assert bodies(recovered.query_by_key("t", "K")) == sent([5, 1, 0])


def test_read_only_handle_follows_the_keys_of_a_writer_that_closes(
    tmp_path: Path, writers: list[Writer]
) -> None:
    path = tmp_path / "s"
    writer = Writer(path, **SMALL)
    writers.append(writer)
    writer("send t 0 1 K")
    writer("flush")
    reader = MessageStore.open(path, read_only=True)
    try:
        assert bodies(reader.query_by_key("t", "K")) == sent([0])
        writer("send t 0 1 K")  # sent, not yet indexed: the reader finds it in the log
        assert bodies(reader.query_by_key("t", "K")) == sent([1, 0])
        writer("send t 0 1 K")
        writer("flush")
        writer.close()  # the reader still has the WAL open: it stays
        assert (path / (KEYS_FILE + "-wal")).exists()
        closed = snapshot(path, skip=())
        assert bodies(reader.query_by_key("t", "K")) == sent([2, 1, 0])
        reader.refresh()
        assert bodies(reader.query_by_key("t", "K")) == sent([2, 1, 0])
        assert snapshot(path, skip=()) == closed
    finally:
        reader.close()
    with MessageStore.open(path, read_only=True) as late:
        assert bodies(late.query_by_key("t", "K")) == sent([2, 1, 0])
    assert snapshot(path, skip=()) == closed


def test_read_only_handle_opened_before_the_writer_starts_sees_its_keys(
    tmp_path: Path, writers: list[Writer]
) -> None:
    path = tmp_path / "s"
    first = Writer(path, **SMALL)
    writers.append(first)
    first("send t 0 1 K")
    first.close()
    with MessageStore.open(path, read_only=True) as reader:
        assert bodies(reader.query_by_key("t", "K")) == sent([0])  # the control
        writer = Writer(path, **SMALL)
        writers.append(writer)
        writer("send t 0 2 K")
        writer("flush")
        assert bodies(reader.query_by_key("t", "K")) == sent([2, 1, 0])
        writer("send t 0 1 K")
        writer.kill()
        assert bodies(reader.query_by_key("t", "K")) == sent([3, 2, 1, 0])
        reader.refresh()
        assert bodies(reader.query_by_key("t", "K")) == sent([3, 2, 1, 0])


def _zero_a_page_the_wal_does_not_replace(keys: Path) -> None:
    """Damage SQLite sees: what the WAL holds a newer copy of is not read from the file."""
    wal = (keys.parent / (KEYS_FILE + "-wal")).read_bytes()
    page_size = int.from_bytes(wal[8:12], "big")
    frame = 24 + page_size
    in_wal = {int.from_bytes(wal[i : i + 4], "big") for i in range(32, len(wal), frame)}
    page = min(set(range(1, keys.stat().st_size // page_size + 1)) - in_wal)
    with open(keys, "r+b") as f:
        f.seek((page - 1) * page_size)
        f.write(bytes(512))


@pytest.mark.parametrize("damage", ["none", "zeroed"])
@pytest.mark.parametrize("shm", ["kept", "deleted"])
def test_verify_reads_a_killed_writers_key_index_as_a_reader_does(
    tmp_path: Path, writers: list[Writer], capsys: pytest.CaptureFixture[str], shm: str, damage: str
) -> None:
    """A killed writer of a new store leaves even its tables in keys.sqlite-wal only:
    verify reads that WAL (readonly_shm=1), or without its -shm the database file alone
    (where the tables need not be yet), and changes no file. Control: a damaged
    keys.sqlite (a writer closed, then a second one was killed) is still reported."""
    path = tmp_path / "s"
    if damage == "zeroed":
        first = Writer(path, **SMALL)
        writers.append(first)
        first("send t 0 100 -")
        first.close()  # its tables and keys are in keys.sqlite
    writer = Writer(path, **SMALL)
    writers.append(writer)
    writer("send t 0 50 -")
    writer("flush")
    writer.kill()
    keys = path / KEYS_FILE
    assert (path / (KEYS_FILE + "-wal")).stat().st_size > 0
    if damage == "zeroed":
        _zero_a_page_the_wal_does_not_replace(keys)
    if shm == "deleted":
        (path / (KEYS_FILE + "-shm")).unlink()
    before = snapshot(path, skip=())
    capsys.readouterr()
    status = main(["verify", str(path)])
    out = capsys.readouterr().out
    assert snapshot(path, skip=()) == before  # bytes and names: nothing written
    if damage == "none":
        assert status == 0 and "No problems found" in out, out
    else:
        assert status == 1 and str(keys) in out and "key index" in out, out


# --- item 5: retention under a read-only handle ------------------------------------


def check_pulled(messages: list[Message], queue_id: int, after: int) -> int:
    """Each message is the one its offset names, offsets ascend past ``after``; returns
    the last offset."""
    for message in messages:
        assert message.queue_offset > after
        assert message.body == body("t", queue_id, message.queue_offset)
        assert message.key == key_for(message.queue_offset)
        after = message.queue_offset
    return after


def test_read_only_handle_follows_retention(tmp_path: Path, writers: list[Writer]) -> None:
    path = tmp_path / "s"
    writer = Writer(path, **SMALL, max_store_bytes=12 * MIN_CHUNK_DATA_SIZE, flush="async")
    writers.append(writer)
    for queue_id in (0, 1):
        writer(f"send t {queue_id} 60 -")
    writer("flush")
    reader = MessageStore.open(path, read_only=True)
    try:
        old = [m for q in (0, 1) for m in reader.pull("t", q, 0, max_count=100).messages]
        assert len(old) == 120
        # Deterministic first: retention removes what the reader has seen (and mapped).
        ranges = writer("run 20")  # sends to both queues in turn, applying retention
        assert ranges["t/0"][0] > 60  # retention removed every message the reader pulled
        with MessageStore.open(path, read_only=True) as fresh:  # just opened: no refresh
            for queue_id in (0, 1):
                assert list(fresh.queue_range("t", queue_id)) == ranges[f"t/{queue_id}"]
        result = reader.pull("t", 0, 0, max_count=5)  # as a writer's pull: from the first
        assert [m.queue_offset for m in result.messages] == list(
            range(ranges["t/0"][0], ranges["t/0"][0] + 5)
        )
        check_pulled(result.messages, 0, -1)
        reader.refresh()
        for queue_id in (0, 1):
            assert list(reader.queue_range("t", queue_id)) == ranges[f"t/{queue_id}"]
        for message in old:
            with pytest.raises(ChunkRemovedError):
                reader.get(message.message_id)
            with pytest.raises(ChunkRemovedError):
                reader.read(message.position)
        keyed = reader.query_by_key("t", "k1", limit=1000)
        assert keyed and all(m.queue_offset >= ranges[f"t/{m.queue_id}"][0] for m in keyed)
        retained = [m for messages in pull_all(reader).values() for m in messages]
        assert keyed == sorted(
            (m for m in retained if m.key == "k1"), key=lambda m: m.position, reverse=True
        )
        # Then concurrently: the writer sends and applies retention while we read.
        writer.start("run 40")
        done = threading.Event()
        final: list[Any] = []

        def wait_for_the_writer() -> None:
            final.append(writer.answer())
            done.set()

        threading.Thread(target=wait_for_the_writer).start()
        offsets, last, pulls = {0: 0, 1: 0}, {0: -1, 1: -1}, 0
        while not done.is_set() or pulls < 10:
            pulls += 1
            for queue_id in (0, 1):
                result = reader.pull("t", queue_id, offsets[queue_id], max_count=50)
                last[queue_id] = check_pulled(result.messages, queue_id, last[queue_id])
                assert result.next_offset >= offsets[queue_id]
                offsets[queue_id] = result.next_offset
            for message in old[pulls % len(old) :][:3]:
                with pytest.raises(ChunkRemovedError):
                    reader.get(message.message_id)
            for message in reader.query_by_key("t", "k3", limit=5):
                assert message.key == "k3"
                assert message.body == body("t", message.queue_id, message.queue_offset)
            reader.refresh()
            reader.offset_for_time("t", 0, 0.0)
        writer.close()
        reader.refresh()
        for queue_id in (0, 1):
            assert list(reader.queue_range("t", queue_id)) == final[0][f"t/{queue_id}"]
            result = reader.pull("t", queue_id, offsets[queue_id], max_count=10_000)
            check_pulled(result.messages, queue_id, last[queue_id])
            assert result.next_offset == final[0][f"t/{queue_id}"][1]
    finally:
        reader.close()


def retained(store: MessageStore) -> list[Message]:
    return [m for messages in pull_all(store).values() for m in messages]


def test_read_only_handle_follows_compaction_then_retention(
    tmp_path: Path, writers: list[Writer], spark: SparkSession
) -> None:
    """A compaction job (in this process) beside the writer, then the writer's retention
    (in its process) of every chunk the handle had read: a handle opened before both reads what
    a handle opened after reads."""
    path = tmp_path / "s"
    # Retention by size: the job leaves the first chunks with no record, and a footer
    # without timestamps stops retention by time.
    limit = 48 * MIN_CHUNK_DATA_SIZE
    writer = Writer(path, "compact", **SMALL, flush="async", max_store_bytes=limit)
    writers.append(writer)
    for queue_id in (0, 1):
        writer(f"send t {queue_id} 60 -")
    writer("flush")
    with MessageStore.open(path, read_only=True) as reader:
        old = retained(reader)
        assert len(old) == 120
        assert compact(path, spark=spark).records_removed > 0
        reader.refresh()
        with MessageStore.open(path, read_only=True) as fresh:
            compacted = retained(fresh)
        assert len(compacted) < len(old)  # the control: the job removed something
        assert retained(reader) == compacted
        for queue_id in (0, 1):
            writer(f"send t {queue_id} 200 -")
        ranges = writer("retain")
        # Without a refresh: a pull goes on from the queue's new first offset.
        result = reader.pull("t", 0, 0, max_count=5)
        assert result.messages and result.messages[0].queue_offset >= ranges["t/0"][0]
        check_pulled(result.messages, 0, -1)
        reader.refresh()
        for queue_id in (0, 1):
            assert list(reader.queue_range("t", queue_id)) == ranges[f"t/{queue_id}"]
        with MessageStore.open(path, read_only=True) as fresh:
            assert retained(reader) == retained(fresh)
            assert reader.query_by_key("t", "k2") == fresh.query_by_key("t", "k2")
        for message in old:
            with pytest.raises(ChunkRemovedError):
                reader.get(message.message_id)
    writer.close()


# --- item 6: a closed store ---------------------------------------------------------


def _closed_calls(message_id: str) -> dict[str, Callable[[MessageStore], object]]:
    """One call per public method, with arguments that work on the open store."""
    return {
        "pull": lambda s: s.pull("t", 0, 0),
        "read": lambda s: s.read(0),
        "get": lambda s: s.get(message_id),
        "query_by_key": lambda s: s.query_by_key("t", "k"),
        "offset_for_time": lambda s: s.offset_for_time("t", 0, 0.0),
        "queue_range": lambda s: s.queue_range("t", 0),
        "queue_positions": lambda s: s.queue_positions("t", 0, 0, 1),
        "key_positions": lambda s: s.key_positions("t", "k"),
        "chunk_files": lambda s: s.chunk_files(),
        "deleted_topics": lambda s: s.deleted_topics(),
        "topics": lambda s: s.topics(),
        "queue_ids": lambda s: s.queue_ids("t"),
        "committed_offset": lambda s: s.committed_offset("g", "t", 0),
        "consumer_groups": lambda s: s.consumer_groups(),
        "consumer": lambda s: s.consumer("g", "t", timeout=0),
        "refresh": lambda s: s.refresh(),
        "topic_policy": lambda s: s.topic_policy("t"),
        "send": lambda s: s.send("t", b"x"),
        "send_batch": lambda s: s.send_batch("t", [b"x"]),
        "create_topic": lambda s: s.create_topic("u", 1),
        "delete_topic": lambda s: s.delete_topic("u"),  # (made by the call above)
        "commit_offset": lambda s: s.commit_offset("g", "t", 0, 1),
        "delete_group": lambda s: s.delete_group("g"),  # (after commit_offset: g exists)
        "flush": lambda s: s.flush(),
        "flush_log": lambda s: s.flush_log(),
        "apply_retention": lambda s: s.apply_retention(),
    }


# Not calls on an open store: open() makes one, and close() may be called twice.
_LIFECYCLE = {"open", "close"}


def test_every_public_method_has_a_closed_case() -> None:
    public = {name for name in dir(MessageStore) if not name.startswith("_")}
    assert public - _LIFECYCLE == set(_closed_calls(""))


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read-only"])
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_every_call_on_a_closed_store_raises_closed_error(
    tmp_path: Path, read_only: bool, flush: Literal["sync", "async"]
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, StoreConfig(flush=flush)) as writer:
        writer.create_topic("t", 1)
        message_id = writer.send("t", b"body", key="k").message_id
        writer.commit_offset("g", "t", 0, 1)
    store = MessageStore.open(path, read_only=read_only)
    calls = _closed_calls(message_id)
    for name, call in calls.items():  # the control: each works on the open store
        try:
            call(store)
        except ReadOnlyError:
            assert read_only, name
    assert bodies(store.query_by_key("t", "k")) == [b"body"]
    before = snapshot(path, skip=())
    store.close()
    store.close()
    closed = snapshot(path, skip=())
    for name, call in calls.items():
        with pytest.raises(ClosedError, match="closed"):
            call(store)
            pytest.fail(f"{name} worked on a closed store")
    assert snapshot(path, skip=()) == closed
    if read_only:
        assert closed == before


def test_read_only_open_racing_retention_lists_the_chunks_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention removing the first chunk files between a read-only open's listing of the
    log and its reading of their headers: the open lists again and sees what a later open
    sees (it raised FileNotFoundError, found by the streaming source's retention test)."""
    from equeue.chunks.manager import ChunkManager

    path = tmp_path / "s"
    config = StoreConfig(**SMALL, max_store_bytes=6 * MIN_CHUNK_DATA_SIZE)
    with MessageStore.open(path, config) as writer:
        for i in range(400):
            writer.send("t", body("t", 0, i) * 4, key=key_for(i))
        writer.flush()
        read_header = ChunkManager._read_header
        raced: list[Path] = []

        def racing(self: ChunkManager, chunk: Path) -> Any:
            if not raced and chunk.parent.name == "messages":
                raced.append(chunk)
                assert writer.apply_retention() > 0  # removes the file about to be read
            return read_header(self, chunk)

        monkeypatch.setattr(ChunkManager, "_read_header", racing)
        with MessageStore.open(path, read_only=True) as reader:
            got = pull_all(reader)
            ranges = [reader.queue_range("t", q) for q in reader.queue_ids("t")]
        monkeypatch.undo()
        assert raced and not raced[0].exists()
        assert ranges == [writer.queue_range("t", q) for q in writer.queue_ids("t")]
        assert 0 < sum(map(len, got.values())) < 400  # retention removed messages
        with MessageStore.open(path, read_only=True) as later:  # the control
            assert got == pull_all(later)


def test_a_view_that_retention_left_empty_reports_a_removed_chunk_as_removed(
    tmp_path: Path,
) -> None:
    """Retention removed every chunk a read-only view held, and the view dropped them
    before it installed any later one (a refresh outrun): a position in one of them is
    ChunkRemovedError, not 'no chunk N' (MessageNotFoundError, as if it never was)."""
    path = tmp_path / "s"
    config = StoreConfig(**SMALL, max_store_bytes=6 * MIN_CHUNK_DATA_SIZE)
    with MessageStore.open(path, config) as writer:
        sent = [writer.send("t", body("t", 0, i) * 4) for i in range(40)]
        writer.flush()
        with MessageStore.open(path, read_only=True) as reader:
            held = len(reader._messages._chunks)
            for i in range(40, 800):
                writer.send("t", body("t", 0, i) * 4)
            writer.flush()
            assert writer.apply_retention() > 0
            first = writer._messages.first_chunk
            assert first is not None and first.start_number > held  # all the view's went
            reader._messages._forget_removed()  # the view drops them, installs nothing
            assert reader._messages._chunks == []
            with pytest.raises(ChunkRemovedError):
                reader._messages.get_chunk(sent[0].position // MIN_CHUNK_DATA_SIZE)
            # A walk of the log from a removed position ends (review13 F1: it spun on the
            # first_position of an empty view, 0, which ChunkRemovedError sent it back to)
            walked: list[list[tuple[int, bytes]]] = []
            walk = threading.Thread(
                target=lambda: walked.append(list(ChunkReader(reader._messages).iter_from(0))),
                daemon=True,
            )
            walk.start()
            walk.join(timeout=20)
            assert walked == [[]], "the walk of an empty view did not end"
            with pytest.raises(ChunkRemovedError):
                reader.read(sent[-1].position)
