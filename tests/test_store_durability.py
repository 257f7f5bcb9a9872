"""Flush policies, group commit, checkpoints, the writer lock and read-only handles."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import tree

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json
from equeue.errors import (
    ConfigError,
    DiskFullError,
    NotAStoreError,
    ReadOnlyError,
    StoreLockedError,
    StoreWriteError,
)
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.store.flush import GroupCommit
from equeue.store.meta import take_lock

SMALL = {"chunk_data_size": 64 * 1024, "queue_chunk_records": 1024}


def config(**overrides: Any) -> StoreConfig:
    return StoreConfig(**(SMALL | overrides))


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


@pytest.fixture
def fdatasyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the fdatasync calls made from now on."""
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    yield calls


# --- flush="sync": group commit ------------------------------------------------------


def test_sync_send_returns_after_a_flush_covering_it(tmp_path: Path) -> None:
    """Every send returns only after a flush that started once its record was written."""
    with MessageStore.open(tmp_path / "s", config(flush="sync")) as store:
        group = store._group
        assert isinstance(group, GroupCommit)
        covered: list[int] = []  # the log end each flush started from
        real_flush = group._flush

        def recording_flush() -> None:
            covered.append(store._messages.committed_position)
            real_flush()

        group._flush = recording_flush
        failures: list[str] = []

        def produce(worker: int) -> None:
            for i in range(150):
                result = store.send("t", b"%d-%d" % (worker, i), queue_id=worker % 4)
                if not covered or max(covered) <= result.position:
                    failures.append(f"send at {result.position} returned before a flush")

        threads = [threading.Thread(target=produce, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert sum(store.queue_range("t", q)[1] for q in range(4)) == 8 * 150
        # Shared flushes: fewer flushes than sends (8 threads, 1,200 sends).
        assert group.flushes < 1200


def test_sync_flushes_once_per_batch_not_per_queue(tmp_path: Path, fdatasyncs: list[int]) -> None:
    with MessageStore.open(tmp_path / "s", config(flush="sync")) as store:
        store.create_topic("t", 4)
        fdatasyncs.clear()
        store.send_batch("t", [b"a", b"b", b"c", b"d"])  # four queues, one log flush
        assert len(fdatasyncs) == 1
        store.send("t", b"e")
        assert len(fdatasyncs) == 2


def test_after_a_failed_fdatasync_sends_are_refused_until_the_store_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed fdatasync may leave its range unwritten however often it is written again
    (ext4 does, in a preallocated file): the sends after it are refused without another
    fdatasync of that chunk, even once the device works again, until the store is
    reopened; what was acknowledged before survives the reopen, and sending resumes."""
    store = MessageStore.open(tmp_path / "s", config(flush="sync"))
    first = store.send("t", b"durable", queue_id=0)
    real = os.fdatasync
    calls: list[int] = []

    def failing(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "injected I/O error")

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(StoreWriteError, match="flush of this send failed"):
        store.send("t", b"flush failed", queue_id=0)
    assert len(calls) == 1
    monkeypatch.setattr(os, "fdatasync", counting)  # the device works again ...
    with pytest.raises(StoreWriteError, match="close and reopen the store") as info:
        store.send("t", b"refused", queue_id=0)  # ... which changes nothing
    assert info.value.errno == errno.EIO
    assert len(calls) == 1  # no fdatasync was tried
    with pytest.raises(StoreWriteError, match="close and reopen the store"):
        store.close()  # ... and releases the files all the same
    with MessageStore.open(tmp_path / "s", config(flush="sync")) as store:
        assert store.read(first.position).body == b"durable"
        later = store.send("t", b"after the reopen", queue_id=0)
        assert len(calls) > 1
        bodies = [m.body for m in store.pull("t", 0, 0, max_count=10).messages]
        # The two refused sends were written before their flush: they may stay, whole.
        assert bodies[0] == b"durable" and bodies[-1] == b"after the reopen"
        assert set(bodies[1:-1]) <= {b"flush failed", b"refused"}
        assert store.read(later.position).body == b"after the reopen"


# --- flush="async" and "os": the background service ------------------------------------


def test_async_does_not_flush_per_send(tmp_path: Path, fdatasyncs: list[int]) -> None:
    cfg = config(flush="async", flush_interval_ms=60_000, flush_thorough_interval_ms=60_000)
    with MessageStore.open(tmp_path / "s", cfg) as store:
        store.create_topic("t")  # (its commit point is an fdatasync: topics.journal)
        fdatasyncs.clear()
        for i in range(200):
            store.send("t", b"m%d" % i)
        assert fdatasyncs == []
        store.flush()
        assert fdatasyncs  # flush() makes it durable under any policy


def test_async_waits_for_flush_least_pages(tmp_path: Path) -> None:
    cfg = config(flush="async", flush_interval_ms=5, flush_least_pages=4)
    with MessageStore.open(tmp_path / "s", cfg) as store:
        store.send("t", b"small")  # far less than 4 pages
        time.sleep(0.1)
        chunk = store._writer._chunk
        assert chunk is not None and chunk.unflushed_bytes > 0
        store.send_batch("t", [b"x" * 1000] * 20)  # > 4 pages
        assert wait_until(lambda: chunk.unflushed_bytes == 0)


def test_async_thorough_flush_and_checkpoint(tmp_path: Path) -> None:
    cfg = config(flush_interval_ms=5, flush_least_pages=1000, flush_thorough_interval_ms=50)
    with MessageStore.open(tmp_path / "s", cfg) as store:
        result = store.send("t", b"small")
        chunk = store._writer._chunk
        assert chunk is not None
        assert wait_until(lambda: chunk.unflushed_bytes == 0)
        assert wait_until(
            lambda: read_json(store.path / "checkpoint.json")["log_position"] > result.position
        )


def test_os_policy_never_flushes_by_itself(tmp_path: Path, fdatasyncs: list[int]) -> None:
    cfg = config(flush="os", flush_interval_ms=5, flush_thorough_interval_ms=20)
    with MessageStore.open(tmp_path / "s", cfg) as store:
        store.create_topic("t")  # (its commit point is an fdatasync: topics.journal)
        fdatasyncs.clear()
        store.send_batch("t", [b"x" * 1000] * 40)
        time.sleep(0.15)
        assert fdatasyncs == []
        chunk = store._writer._chunk
        assert chunk is not None and chunk.unflushed_bytes > 0
        store.flush()
        assert chunk.unflushed_bytes == 0


def test_background_flush_failure_refuses_sends_until_the_store_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(flush="async", flush_interval_ms=5, flush_least_pages=0)
    store = MessageStore.open(tmp_path / "s", cfg)
    acknowledged = store.send("t", b"before")
    real = os.fdatasync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "injected: no space left")

    monkeypatch.setattr(os, "fdatasync", full)
    store.send("t", b"unflushed")  # gives the service something to flush
    assert wait_until(lambda: store._flush_error is not None)
    next_offset = store.queue_range("t", 0)[1]
    with pytest.raises(StoreWriteError, match="background flush failed") as info:
        store.send("t", b"refused", queue_id=0)
    assert info.value.errno == errno.ENOSPC
    assert store.queue_range("t", 0)[1] == next_offset  # nothing written
    monkeypatch.setattr(os, "fdatasync", real)
    with pytest.raises(DiskFullError, match="close and reopen the store"):
        store.flush()  # the failed range is never flushed again, space or not
    with pytest.raises(StoreWriteError, match="background flush failed"):
        store.send("t", b"still refused", queue_id=0)
    with pytest.raises(DiskFullError):
        store.close()
    with MessageStore.open(tmp_path / "s", cfg) as store:
        assert store.read(acknowledged.position).body == b"before"
        store.send("t", b"after")
        store.flush()


def test_disk_full_error_type(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "injected: no space left")

    with MessageStore.open(tmp_path / "s", config(flush="sync")) as store:
        store.create_topic("t")  # the send's own fdatasync fails, not the topic's
        monkeypatch.setattr(os, "fdatasync", full)
        with pytest.raises(StoreWriteError) as info:
            store.send("t", b"x")
        assert isinstance(info.value.__cause__, DiskFullError)
        with pytest.raises(DiskFullError):  # close() reports the failed final flush ...
            store.close()
    monkeypatch.undo()
    with MessageStore.open(tmp_path / "s") as store:  # ... and still released the lock
        assert store.queue_range("t", 0)[1] == 1


def test_batch_cut_short_by_a_full_disk_lists_what_was_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MessageStore.open(tmp_path / "s", config()) as store:
        store.create_topic("t", 1)
        manager = store._messages

        def full(*args: Any, **kwargs: Any) -> Any:
            raise DiskFullError(errno.ENOSPC, "injected: creating a chunk failed")

        store.send("t", b"first")  # the first chunk exists; the next one cannot be made
        monkeypatch.setattr(manager, "add_new_chunk", full)
        bodies = [b"%03d" % i * 1000 for i in range(100)]  # 300 KB: several chunks' worth
        with pytest.raises(DiskFullError) as info:
            store.send_batch("t", bodies)
        stored = info.value.sent
        assert 0 < len(stored) < len(bodies)
        assert store.queue_range("t", 0) == (0, 1 + len(stored))
        for result, body in zip(stored, bodies, strict=False):
            assert store.read(result.position).body == body
        monkeypatch.undo()
        more = store.send("t", b"after")
        assert more.queue_offset == 1 + len(stored)


# --- checkpoints -----------------------------------------------------------------------


def test_checkpoint_records_durable_positions(tmp_path: Path) -> None:
    cfg = config(flush_interval_ms=60_000, flush_thorough_interval_ms=60_000)
    with MessageStore.open(tmp_path / "s", cfg) as store:
        store.create_topic("t", 2)
        store.send_batch("t", [b"a", b"b", b"c"])
        store.flush()
        checkpoint = read_json(store.path / "checkpoint.json")
        assert checkpoint["log_position"] == store._messages.committed_position
        assert checkpoint["queues"] == {"t": [2, 1]}
        assert store._keys.indexed_position == checkpoint["log_position"]


def test_queue_losing_checkpointed_entries_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, config()) as store:
        store.create_topic("t", 1)
        bodies = [b"m%d" % i for i in range(50)]
        store.send_batch("t", bodies)
    # Damage: the queue loses its last 20 entries, which the checkpoint says are durable.
    queue_file = sorted((path / "queues" / "t" / "0").glob("chunk-*"))[-1]
    data = bytearray(queue_file.read_bytes())
    data[HEADER_SIZE + 30 * QUEUE_RECORD_SIZE : HEADER_SIZE + 50 * QUEUE_RECORD_SIZE] = bytes(
        20 * QUEUE_RECORD_SIZE
    )
    queue_file.write_bytes(bytes(data))
    with MessageStore.open(path, config()) as store:
        assert any("checkpoint recorded 50" in p for p in store.recovery.problems)
        assert store.recovery.redispatched == 20
        assert [m.body for m in store.pull("t", 0, 0, max_count=100).messages] == bodies


def test_open_without_config_keeps_the_stores_shape(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, config()) as store:
        store.send("t", b"x")
    with MessageStore.open(path) as store:
        assert store.config.chunk_data_size == SMALL["chunk_data_size"]
        assert store.pull("t", store.send("t", b"y", queue_id=0).queue_id, 0).messages
    with MessageStore.open(path, StoreConfig()) as store:  # unset: the store's own
        assert store.config.chunk_data_size == SMALL["chunk_data_size"]
    with pytest.raises(ConfigError, match="chunk_data_size"):
        MessageStore.open(path, StoreConfig(chunk_data_size=StoreConfig().layout.chunk_data_size))


# --- one writer, read-only handles ------------------------------------------------------

_HOLD = """
import sys, time
from equeue import MessageStore
store = MessageStore.open(sys.argv[1])
store.send("t", b"from the other process")
store.flush()
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


def test_second_writer_in_another_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    MessageStore.open(path, config()).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            MessageStore.open(path)
        with MessageStore.open(path, read_only=True) as reader:
            assert reader.pull("t", 0, 0).messages[0].body == b"from the other process"
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(10)
    MessageStore.open(path).close()  # the lock went with the process


_QUERY = """
import os, sys
from pathlib import Path
from equeue import MessageStore
from equeue.store.meta import writer_running
reader = MessageStore.open(sys.argv[1], read_only=True)
print("ready", flush=True)
count = 0
while not os.path.exists(sys.argv[2]):
    if sys.argv[3] == "query":
        reader.query_by_key("t", "k", 1)
    else:  # the probe each query (and verify) makes, alone: many more per second
        writer_running(Path(sys.argv[1]))
    count += 1
print(count, flush=True)
"""


def test_readers_querying_keys_never_refuse_a_writers_open(tmp_path: Path) -> None:
    """Each query_by_key of a read-only handle probes LOCK (is a writer running?) with a
    shared lock for an instant; a writer's open meeting that probe waits it out rather
    than raise StoreLockedError naming the previous writer's pid."""
    path, stop = tmp_path / "s", tmp_path / "stop"
    with MessageStore.open(path, config()) as store:
        store.send("t", b"v", key="k")
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _QUERY, str(path), str(stop), how],
            stdout=subprocess.PIPE,
            text=True,
        )
        for how in ("query", "probe")
    ]
    refused = []
    try:
        for reader in readers:
            assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 3
        for _ in range(100):
            if time.monotonic() > deadline:
                break
            try:
                MessageStore.open(path).close()
            except StoreLockedError as exc:
                refused.append(str(exc))
                break  # one is the failure; no need to go on
        # The lock alone, many more times a second than whole opens (the part that waits).
        for _ in range(3000 if not refused else 0):
            try:
                take_lock(path).close()
            except StoreLockedError as exc:
                refused.append(str(exc))
                break
    finally:
        stop.touch()
        queries = [int(r.communicate(timeout=30)[0]) for r in readers]
    assert refused == []
    assert all(queries), queries  # the readers did query meanwhile
    # Control: a writer that holds the store still refuses the open, naming its pid.
    with MessageStore.open(path), pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
        MessageStore.open(path)


def test_second_writer_in_this_process_is_refused(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s", config()), pytest.raises(StoreLockedError):
        MessageStore.open(tmp_path / "s", config())


def test_read_only_beside_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, config()) as writer:
        writer.create_topic("t", 2)
        first = writer.send("t", b"one", queue_id=0)
        with MessageStore.open(path, read_only=True) as reader:
            assert reader.read_only
            assert [m.body for m in reader.pull("t", 0, 0).messages] == [b"one"]
            # Written after the reader opened, across a chunk rollover: pulls see it.
            bodies = [b"%d" % i * 300 for i in range(400)]
            for body in bodies:
                writer.send("t", body, queue_id=1)
            pulled: list[bytes] = []
            offset = 0
            while True:
                batch = reader.pull("t", 1, offset, max_count=64)
                if not batch.messages:
                    break
                pulled += [m.body for m in batch.messages]
                offset = batch.next_offset
            assert pulled == bodies
            assert reader.get(first.message_id).body == b"one"
            # New topics and consumer offsets show after refresh().
            writer.send("new", b"n", queue_id=0)
            writer.commit_offset("g", "t", 0, 1)
            assert reader.pull("new", 0, 0).messages[0].body == b"n"
            reader.refresh()
            assert reader.committed_offset("g", "t", 0) == 1
            for attempt in (
                lambda: reader.send("t", b"x"),
                lambda: reader.send_batch("t", [b"x"]),
                lambda: reader.create_topic("u", 1),
                lambda: reader.commit_offset("g", "t", 0, 1),
                lambda: reader.flush(),
                lambda: reader.apply_retention(),
            ):
                with pytest.raises(ReadOnlyError, match="read-only"):
                    attempt()


def test_read_only_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, config()) as writer:
        for i in range(300):
            writer.send("t", b"m%d" % i * 50, key=f"k{i % 7}")
        writer.commit_offset("g", "t", 0, 3)
    before = tree(path)
    with MessageStore.open(path, read_only=True) as reader:
        for queue_id in reader.queue_ids("t"):
            assert reader.pull("t", queue_id, 0, max_count=500).messages
        assert reader.query_by_key("t", "k3")
        assert reader.committed_offset("g", "t", 0) == 3
        reader.refresh()
    assert tree(path) == before


def test_read_only_pull_waits_for_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, config()) as writer:
        writer.create_topic("t", 1)
        with MessageStore.open(path, read_only=True) as reader:
            timer = threading.Timer(0.05, lambda: writer.send("t", b"late"))
            timer.start()
            result = reader.pull("t", 0, 0, wait=5.0)
            timer.join()
            assert [m.body for m in result.messages] == [b"late"]


def test_read_only_of_no_store(tmp_path: Path) -> None:
    with pytest.raises(NotAStoreError, match="not an equeue store"):
        MessageStore.open(tmp_path / "nothing", read_only=True)
    assert not (tmp_path / "nothing").exists()
