"""Retention and compaction over many queues (issue 25), with the open-queue cache
closing and reopening queues all the while; ``equeue verify`` on the result (the
control) and on a planted fault."""

from __future__ import annotations

import datetime as dt
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from compaction_model import all_messages, expected_removed
from many_queues_child import low_config

from equeue import MessageStore, OutgoingMessage
from equeue.compaction.job import compact
from equeue.format.chunk import HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.verify import verify_store

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Model = dict[tuple[str, int], list[bytes]]  # every body sent to a queue, by offset
Positions = dict[tuple[str, int], list[int]]  # and the log position each got
RECORDS = 342  # queue entries per queue chunk: the smallest allowed (4 KiB chunks)


def _body(topic: str, queue_id: int, n: int) -> bytes:
    return f"{topic}/{queue_id}/{n}/".encode() + b"." * 60


def _send_round(store: MessageStore, model: Model, positions: Positions) -> None:
    for (topic, queue_id), bodies in model.items():
        bodies.append(_body(topic, queue_id, len(bodies)))
        sent = store.send(topic, bodies[-1], queue_id=queue_id)
        assert sent.queue_offset == len(bodies) - 1
        positions[topic, queue_id].append(sent.position)


def _send_hot(
    store: MessageStore, model: Model, positions: Positions, hot: list[tuple[str, int]], count: int
) -> None:
    for topic, queue_id in hot:  # a batch per queue: each reopens it (more than stay open)
        bodies = model[topic, queue_id]
        batch = [_body(topic, queue_id, len(bodies) + i) for i in range(count)]
        sent = store.send_batch(topic, [OutgoingMessage(b, queue_id=queue_id) for b in batch])
        assert [r.queue_offset for r in sent] == list(range(len(bodies), len(bodies) + count))
        bodies += batch
        positions[topic, queue_id] += [r.position for r in sent]


def _pull_all(store: MessageStore, topic: str, queue_id: int, offset: int) -> list[bytes]:
    got: list[bytes] = []
    for _ in range(10_000):  # bounded: 200 a pull
        result = store.pull(topic, queue_id, offset, 200)
        got += [m.body for m in result.messages]
        if result.next_offset == offset:
            return got
        offset = result.next_offset
    raise AssertionError(f"{topic}/{queue_id}: no end reached")


def test_retention_removes_whole_chunks_across_400_queues_while_they_are_evicted(
    tmp_path: Path,
) -> None:
    """400 queues, 9 open at once; retention runs in the store's service thread every
    few milliseconds while every queue is written (each send reopens its queue), and 8
    of them are written past several queue chunks. Each queue keeps exactly the messages
    whose log chunk survives, from its new first offset on, and no queue chunk whose
    entries all point below the log's start. (Round 20 ran 2,000 queues, 48 s: 400 are
    still 44 times the open ones, every send still reopens its queue, and the closed
    queues' path in retention.py is taken for every queue but the 9 open.)"""
    config = low_config(
        chunk_data_size=64 * 1024,
        queue_chunk_records=RECORDS,
        max_store_bytes=512 * 1024,
        flush_thorough_interval_ms=20,  # a checkpoint, then retention, every 20 ms
    )
    topics = [f"t{i:03d}" for i in range(100)]
    model: Model = {(t, q): [] for t in topics for q in range(4)}
    positions: Positions = {key: [] for key in model}
    hot = [(t, 1) for t in topics[::25]] + [(t, 3) for t in topics[7::25]]
    with MessageStore.open(tmp_path, config) as store:
        for topic in topics:
            store.create_topic(topic, 4)
        _send_round(store, model, positions)
        _send_hot(store, model, positions, hot, 3 * RECORDS)
        _send_round(store, model, positions)
        # Closed and reopened throughout: the two rounds closed every queue but the 9 open.
        assert store._files.closed >= 2 * len(model) - 9
        store.apply_retention()  # what the service has not removed yet
        first_log = store._messages.first_position
        assert first_log > 0
        ranges = {key: store.queue_range(*key) for key in model}
        moved = 0
        for key, bodies in model.items():
            first, end = ranges[key]
            # The first offset is the first whose message the log still holds.
            assert (first, end) == (sum(p < first_log for p in positions[key]), len(bodies)), (
                key,
                first,
                end,
                first_log,
                positions[key][:4],
                store._queue(*key).is_open,
            )
            moved += first > 0
            assert _pull_all(store, *key, first) == bodies[first:], key
            files = sorted((tmp_path / "queues" / key[0] / str(key[1])).glob("chunk-*"))
            assert len(files) == (end - 1) // RECORDS - first // RECORDS + 1, (key, files)
        assert moved == len(model)  # every queue lost its oldest messages
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.problems == []
        assert {key: store.queue_range(*key) for key in model} == ranges
    assert verify_store(tmp_path) == []  # the control
    key = hot[0]
    (last,) = sorted((tmp_path / "queues" / key[0] / str(key[1])).glob("chunk-*"))[-1:]
    first, _ = ranges[key]
    slot = HEADER_SIZE + (first % RECORDS + 1) * QUEUE_RECORD_SIZE
    with open(last, "r+b") as f:  # the second live entry's position, moved by one
        f.seek(slot)
        stored = int.from_bytes(f.read(8), "little")
        f.seek(slot)
        f.write((stored + 1).to_bytes(8, "little"))
    problems = verify_store(tmp_path)
    assert [(Path(p.file), p.kind, p.offset) for p in problems] == [(last, "queue entry", slot)]


def test_a_removal_of_log_chunks_opens_no_queue_it_leaves_in_its_first_chunk(
    tmp_path: Path,
) -> None:
    """600 queues of one message each, then 8 written further: a removal of the first
    log chunks moves the 600 first offsets without opening a queue (before: every queue
    was opened, 600 reopens under the store's lock, about 1 ms each), and a queue
    reopened afterwards (by a send) keeps its new first offset."""
    config = low_config(chunk_data_size=64 * 1024, queue_chunk_records=RECORDS)
    topics = [f"t{i:03d}" for i in range(150)]
    model: Model = {(t, q): [] for t in topics for q in range(4)}
    positions: Positions = {key: [] for key in model}
    hot = [(t, 0) for t in topics[:8]]
    with MessageStore.open(tmp_path, config) as store:
        for topic in topics:
            store.create_topic(topic, 4)
        _send_round(store, model, positions)
        _send_hot(store, model, positions, hot, 3 * RECORDS)
    retained = low_config(
        chunk_data_size=64 * 1024, queue_chunk_records=RECORDS, max_store_bytes=256 * 1024
    )
    with MessageStore.open(tmp_path, retained) as store:
        opened = store._files.opened
        assert store.apply_retention() > 0
        assert store._files.opened - opened <= len(hot)  # before: 600
        first_log = store._messages.first_position
        for key in model:
            expected = sum(p < first_log for p in positions[key])
            assert store.queue_range(*key) == (expected, len(model[key])), key
        cold = ("t100", 2)
        assert store.queue_range(*cold) == (1, 1)
        assert store.send(*cold[:1], b"after", queue_id=cold[1]).queue_offset == 1
        for topic in topics[101:]:  # the cold queue closed again, and reopened by a pull
            store.send(topic, b"x", queue_id=0)
        assert store.queue_range(*cold) == (1, 2)
        assert [m.body for m in store.pull(*cold, 0).messages] == [b"after"]
    with MessageStore.open(tmp_path, retained) as store:
        assert store.recovery.problems == []
        assert store.queue_range(*cold) == (1, 2)
    assert verify_store(tmp_path) == []


def test_compaction_over_1000_queues_keeps_every_survivor_where_it_was(
    tmp_path: Path, spark: SparkSession
) -> None:
    """1,000 queues (9 open at once), keyed messages in compacted topics and plain ones
    in topics with retention; a Spark job compacts the log; every queue then pulls what
    the reference leaves, at the offsets and positions they had."""
    config = low_config(chunk_data_size=16 * 1024, queue_chunk_records=RECORDS, flush="os")
    rng = random.Random(25)
    with MessageStore.open(tmp_path, config) as store:
        for i in range(250):
            if i % 2:
                store.create_topic(f"k{i:03d}", 4, cleanup="compact")
            else:
                store.create_topic(f"d{i:03d}", 4, retention=dt.timedelta(seconds=30))
        for round_ in range(2):
            for topic in store.topics():
                for q in range(4):
                    key = f"key{rng.randrange(3)}" if topic.startswith("k") else None
                    body = f"{topic}/{q}/{round_}".encode() + os.urandom(rng.randrange(40))
                    store.send(topic, body, key=key, queue_id=q)
        assert store._files.closed > 1000
    with MessageStore.open(tmp_path, read_only=True) as store:
        before = all_messages(store)
    now = time.time() + 60  # the plain topics' messages are past their 30 s retention
    removed = expected_removed(tmp_path, now)
    assert len(removed) > 400
    report = compact(tmp_path, spark=spark, now=now)
    assert report.records_removed == len(removed)
    with MessageStore.open(tmp_path, config) as store:
        assert store.recovery.clean
        after = all_messages(store)  # every queue pulled through, queues evicted meanwhile
        assert store._files.closed > 900
    expected = {p: m for p, m in before.items() if p not in removed}
    assert sorted(after) == sorted(expected)
    for position, message in after.items():
        was = expected[position]
        assert (message.topic, message.queue_id, message.queue_offset, message.body) == (
            was.topic,
            was.queue_id,
            was.queue_offset,
            was.body,
        )
    assert verify_store(tmp_path) == []  # the control
    compacted = [
        p for p in sorted((tmp_path / "messages").glob("chunk-*")) if not p.name.endswith(".0000")
    ]
    assert compacted, "the job wrote replacement chunks"
    target = compacted[0]
    with open(target, "r+b") as f:  # one byte of the first surviving record's body
        f.seek(HEADER_SIZE + 60)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 60)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = verify_store(tmp_path)
    # The chunk, and the queue entry that points at the damaged record (one of 1,000).
    assert {(Path(p.file), p.kind) for p in problems if p.kind != "queue entry"} >= {
        (target, "checksum")
    }, problems
    assert {Path(p.file) for p in problems if p.kind != "queue entry"} == {target}, problems
    pointing = [p for p in problems if p.kind == "queue entry"]
    assert len(pointing) == 1 and "where no valid message record starts" in pointing[0].reason


@pytest.mark.parametrize("damaged", [False, True])
def test_a_removal_of_log_chunks_does_not_trust_a_deferred_queues_unchecked_entries(
    tmp_path: Path, damaged: bool
) -> None:
    """A queue whose open the store's open deferred has had none of its checks: the
    first offset retention finds for it by preads comes only from entries that point
    at their own messages. Damaged (its second chunk's first entry, which the search
    reads first, moved to the queue's first message, a record retention removes): the
    queue is opened, found damaged and rebuilt, as before the preads; the first offset
    stays the first whose message the log holds (before: one past the damaged entry,
    343 where 225 was right, 118 live messages skipped, and the checkpoint kept it). The
    control opens only the queue that has a chunk to remove."""
    config = low_config(chunk_data_size=64 * 1024, queue_chunk_records=RECORDS)
    hot, count = ("t00", 0), 2 * RECORDS + 1  # the search's first probe: offset RECORDS
    with MessageStore.open(tmp_path, config) as store:
        for i in range(10):  # 40 queues: more than stay open, so the next open defers them
            store.create_topic(f"t{i:02d}", 4)
            for q in range(1, 4):
                store.send(f"t{i:02d}", b"x", queue_id=q)
        bodies = [_body(*hot, n) + b"." * 140 for n in range(count)]
        sent = store.send_batch(hot[0], [OutgoingMessage(b, queue_id=0) for b in bodies])
        positions = [r.position for r in sent]
    if damaged:
        chunk = sorted((tmp_path / "queues" / "t00" / "0").glob("chunk-*"))[1]
        with open(chunk, "r+b") as f:
            f.seek(HEADER_SIZE)
            f.write((positions[0] + 1).to_bytes(8, "little"))
    retained = low_config(
        chunk_data_size=64 * 1024, queue_chunk_records=RECORDS, max_store_bytes=160 * 1024
    )
    with MessageStore.open(tmp_path, retained) as store:
        assert store._queue(*hot).deferred
        opened = store._files.opened
        assert store.apply_retention() > 0
        first_log = store._messages.first_position
        expected = sum(p < first_log for p in positions)
        assert 0 < expected < RECORDS  # the probed entry (offset RECORDS) is live
        assert store.queue_range(*hot) == (expected, count)
        got = store.pull(*hot, expected, count).messages
        assert [m.position for m in got] == positions[expected:]
        rebuilt = [p for p in store.recovery.problems if "t00/0" in p and "was rebuilt" in p]
        assert len(rebuilt) == damaged
        if not damaged:
            assert store._files.opened - opened <= 1
    with MessageStore.open(tmp_path, retained) as store:
        assert store.recovery.problems == []
        assert store.queue_range(*hot) == (expected, count)
