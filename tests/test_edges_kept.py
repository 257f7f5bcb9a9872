"""Who says a chunk file went missing: the store's own removals (retention, a topic's
deletion) seen by a pull that holds a chunk object of a queue the queue cache let go of
are a ChunkRemovedError (retried by consumers, skipped by readers), not damage; a read-only
view tells a hand-deleted chunk in the middle of a directory (MissingChunkError naming it)
from the writer's retention of the oldest ones (skipped). Real stores, real unlinks; the
race's interleaving is forced by running the other threads' part inside the pull's first
mapping of a queue chunk."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from server_helpers import short_home

from equeue import MessageStore, StoreConfig
from equeue.chunks import chunk as chunkmod
from equeue.errors import ChunkRemovedError, MissingChunkError

CONFIG = StoreConfig(
    chunk_data_size=4096,
    queue_chunk_records=342,
    default_queue_count=1,
    max_open_chunks=4,
    retention=dt.timedelta(seconds=1),
)
COUNT = 800  # 35 log chunks, 3 queue chunks


def body(i: int) -> bytes:
    return b"m%04d" % i + b"x" * 100


directory = pytest.fixture(short_home, name="directory")


def _filled(path: Path) -> MessageStore:
    store = MessageStore.open(path, CONFIG)
    store.create_topic("t", 1)
    store.send_batch("t", [body(i) for i in range(COUNT)])
    return store


def _meanwhile(monkeypatch: pytest.MonkeyPatch, other_threads: Callable[[], None]) -> None:
    """Run other_threads once, when a pull first maps a queue chunk it already holds."""
    original = chunkmod.Chunk.mapping
    armed = [True]

    def mapping(self: chunkmod.Chunk) -> object:
        if armed[0] and "queues" in str(self.path) and self._mm is None:
            armed[0] = False
            other_threads()
        return original(self)

    monkeypatch.setattr(chunkmod.Chunk, "mapping", mapping)


def test_retention_under_a_pull_of_a_released_queue_is_a_removal(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _filled(directory / "s")
    try:
        store._files.close_idle()  # the pull opens queue chunk 0's file itself
        removed: list[int] = []

        def other_threads() -> None:
            with store._lock:
                store._files.close_idle()  # the cache lets the queue go (new manager later)
            removed.append(store.apply_retention(time.time() + 3600))

        _meanwhile(monkeypatch, other_threads)
        with pytest.raises(ChunkRemovedError):
            store.pull("t", 0, 0, 10)
        assert removed and removed[0] > 0
        assert store.queue_range("t", 0)[0] > 0  # queue chunk 0 went with retention
    finally:
        monkeypatch.undo()
        store.close()


def test_a_topic_deleted_under_a_pull_is_a_removal(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _filled(directory / "s")
    try:
        store._files.close_idle()
        _meanwhile(monkeypatch, lambda: store.delete_topic("t"))
        with pytest.raises(ChunkRemovedError):
            store.pull("t", 0, 0, 10)
        assert not (directory / "s" / "queues" / "t").exists()
    finally:
        monkeypatch.undo()
        store.close()


def test_control_the_same_pull_without_interference_is_served(directory: Path) -> None:
    store = _filled(directory / "s")
    try:
        store._files.close_idle()
        assert [m.body for m in store.pull("t", 0, 0, 10).messages] == [body(i) for i in range(10)]
    finally:
        store.close()


def _log_files(path: Path) -> list[Path]:
    return sorted((path / "messages").iterdir(), key=lambda p: p.name)


def test_a_read_only_view_reports_a_hand_deleted_middle_chunk(directory: Path) -> None:
    path = directory / "s"
    _filled(path).close()
    with MessageStore.open(path, CONFIG, read_only=True) as view:
        assert len(view.pull("t", 0, 0, COUNT).messages) == COUNT
        victim = _log_files(path)[10]
        os.unlink(victim)
        with pytest.raises(MissingChunkError) as caught:
            view.pull("t", 0, 0, COUNT)
        assert victim.name in str(caught.value)


def test_control_a_read_only_view_skips_the_writers_retention(directory: Path) -> None:
    writer = _filled(directory / "s")
    try:
        with MessageStore.open(directory / "s", CONFIG, read_only=True) as view:
            assert len(view.pull("t", 0, 0, COUNT).messages) == COUNT
            writer.send_batch("t", [body(COUNT)])  # retention keeps the chunk being written
            assert writer.apply_retention(time.time() + 3600) > 0
            first = writer.queue_range("t", 0)[0]
            pulled = view.pull("t", 0, first, COUNT).messages  # no error: a removal
            # (the send just made may not be visible to the view yet: flush="async")
            expected = [body(i) for i in range(first, COUNT + 1)]
            assert [m.body for m in pulled] in (expected, expected[:-1])
    finally:
        writer.close()


def test_a_read_only_view_takes_a_queue_file_gone_for_a_removal(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A topic's deletion removes a queue's files in no particular order: the view, whose
    pull holds queue chunk 2 when its file goes first (chunks 0 and 1 still there), must
    not call that damage."""
    path = directory / "s"
    _filled(path).close()
    with MessageStore.open(path, CONFIG, read_only=True) as view:

        def other_threads() -> None:
            os.unlink(path / "queues" / "t" / "0" / "chunk-000000000002.0000")

        _meanwhile(monkeypatch, other_threads)
        try:
            view.pull("t", 0, 700, 10)
        except ChunkRemovedError:
            pass
        finally:
            monkeypatch.undo()
        assert not (path / "queues" / "t" / "0" / "chunk-000000000002.0000").exists()
