"""The C Sender keeps what it read of the chunks' write state while nothing it uses
changed (equeue/cext/sendstate.c): across a round robin over many queues (their writers'
entries must not push each other out) and across flushes (which change a chunk's dict,
not what a send uses). Sender.rereads counts the sends that read it all again. And what
it keeps never changes a result: sends after flushes (sync and async), rollovers, a
retention deletion and a reopen write what the Python path writes."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, StoreConfig, speedups
from equeue.format.chunk import HEADER_SIZE

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
NOW_NS = 1_700_000_000_123_456_789


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(time, "time_ns", lambda: NOW_NS)
    yield


def rereads(store: MessageStore) -> tuple[int, int]:
    sender: Any = store._appender.sender  # the store's _speedups.Sender
    log, queue = sender.rereads
    return int(log), int(queue)


def sent_rereads(store: MessageStore, topic: str, sends: int) -> tuple[int, int]:
    before = rereads(store)
    for i in range(sends):
        store.send(topic, b"m%d" % i)
    after = rereads(store)
    return after[0] - before[0], after[1] - before[1]


@needs_c
@pytest.mark.parametrize("queues", [4, 17])
def test_queue_writers_stay_remembered_in_a_round_robin(tmp_path: Path, queues: int) -> None:
    """17 queue writers cannot all have a slot of their own among 16 (the table before):
    two took turns in one, and each send to either read its chunk's attributes again."""
    config = StoreConfig(flush="async", max_open_files=4 * queues + 64)
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic("t", queues)
        sent_rereads(store, "t", 2 * queues)  # each queue's writer opened and remembered
        log, queue = sent_rereads(store, "t", 20 * queues)
        assert (log, queue) == (0, 0)


@needs_c
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_state_stays_remembered_across_flushes(tmp_path: Path, flush: str) -> None:
    """A flush sets flushed_end and synced_end on the chunk: its dict's version moves, the
    fields a send uses do not (flush="sync": one flush a send)."""
    with MessageStore.open(tmp_path, StoreConfig(flush=flush)) as store:  # type: ignore[arg-type]
        store.create_topic("t", 2)
        sent_rereads(store, "t", 4)
        before = rereads(store)
        for i in range(100):
            store.send("t", b"f%d" % i)
            store.flush()
            store._writer._chunk.last_used += 1  # type: ignore[union-attr]  # as a read does
        after = rereads(store)
        assert (after[0] - before[0], after[1] - before[1]) == (0, 0)
        # Python moved a field a send uses: that one is read again, and honoured
        chunk = store._writer._chunk
        assert chunk is not None
        chunk.writable_end = chunk.data_end  # no room: the Python path reserves more
        store.send("t", b"after")
        assert rereads(store)[0] > after[0]
        assert [m.body for m in store.pull("t", 0, 0, 1000).messages][-1] in (b"after", b"f99")


def data_areas(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()[HEADER_SIZE:-128]
        for path in sorted(directory.rglob("chunk-*"))
        if path.suffix != ".tmp"
    }


def scenario(path: Path, flush: str) -> tuple[list[Any], list[list[Any]], dict[str, bytes]]:
    """Sends between flushes, rollovers of the log and the queue chunks, a retention
    deletion and a reopen: the results, the messages pulled and the files' bytes."""
    config = StoreConfig(
        flush=flush,  # type: ignore[arg-type]
        chunk_data_size=8192,
        queue_chunk_records=342,
        retention=dt.timedelta(seconds=1),
    )
    results: list[Any] = []

    def sends(store: MessageStore, start: int, count: int) -> None:
        for i in range(start, start + count):
            results.append(store.send("t", b"%d:" % i + b"r" * (i % 150)))
            if i % 9 == 4:
                store.flush()
            if i % 31 == 7:
                results.append(store.send("t", b"k%d" % i, key=f"k{i % 4}"))

    with MessageStore.open(path, config) as store:
        store.create_topic("t", 5)
        sends(store, 0, 600)
        removed = store.apply_retention(now=NOW_NS / 1e9 + 60)
        assert removed > 0  # completed log chunks went
        sends(store, 600, 300)
    with MessageStore.open(path, config) as store:
        sends(store, 900, 300)
        messages = [
            [m._replace(message_id=m.message_id[8:]) for m in store.pull("t", q, 0, 10**5).messages]
            for q in store.queue_ids("t")
        ]
    rows = [(r.topic, r.queue_id, r.queue_offset, r.position, r.message_id[8:]) for r in results]
    return rows, messages, data_areas(path)


@needs_c
@pytest.mark.parametrize("flush", ["sync", "async"])
def test_sends_after_flush_rollover_retention_and_reopen_match_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_clock: None, flush: str
) -> None:
    fast = scenario(tmp_path / "c", flush)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = scenario(tmp_path / "python", flush)
    assert fast[0] == slow[0]
    assert fast[1] == slow[1]
    assert fast[2] == slow[2]
    assert sum(map(len, fast[1])) > 500  # what retention left, and the sends after it
    assert sum("queues" not in name for name in fast[2]) > 5  # log chunks rolled over


def test_a_python_path_store_has_no_sender_to_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: without the accelerator the store's send is the Python method."""
    monkeypatch.setattr(speedups, "SPEEDUPS", None)
    with MessageStore.open(tmp_path, StoreConfig(flush="async")) as store:
        store.create_topic("t", 2)
        store.send("t", b"x")
        assert store._appender.sender is None
