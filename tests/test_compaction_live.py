"""Compaction of a live store: a producer thread keeps sending and a consumer keeps
pulling while the job runs; nothing is lost, nothing is corrupt, and the running store
(and a read-only view) picks up the installed replacements without a restart.

One job runs per module (Spark is slow); the module fixture runs the whole scenario
and the tests check what it left, in file order (the last one closes the store):

* the store is pre-filled and checkpointed, then a read-only view is opened (``early``:
  its last chunk is still being written);
* producer and consumer threads start; once the writer has moved two chunks past the
  early view's last one, the producer pauses, the store is flushed (the chunks before
  become eligible), a second read-only view opens (``late``), and the job starts;
* the producer resumes as soon as the job has taken its snapshot, from which the
  reference model (tests/compaction_model.py) computes what the job must remove;
* the running store adopts the replacements in its service thread; the producer
  sends a few hundred more, then both threads stop.
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from compaction_model import all_messages, expected_removed

from equeue import Message, MessageStore, SendResult, StoreConfig
from equeue.compaction import job
from equeue.compaction.job import CompactionReport, compact
from equeue.compaction.plan import Snapshot, take_snapshot
from equeue.errors import CompactedAwayError, MessageNotFoundError
from equeue.format.chunk import HEADER_SIZE, ChunkHeader, parse_chunk_file_name
from equeue.inspect.verify import Verifier
from equeue.store.meta import MESSAGES_DIR

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COMPACTED = "state"  # cleanup="compact", 2 queues
PLAIN = "events"  # cleanup="delete" without retention, 1 queue
KEYS = 40
PREFILL = 1500
MORE_AFTER_ADOPTION = 300
CONFIG = StoreConfig(
    chunk_data_size=16 * 1024,
    queue_chunk_records=1024,
    flush="async",
    flush_interval_ms=20,
    flush_thorough_interval_ms=200,
    max_open_chunks=4,
)
WAIT = 60.0  # seconds; a bound on waiting for the threads, never a timing assertion


@dataclass(frozen=True)
class Outgoing:
    topic: str
    body: bytes
    key: str | None
    tag: str


def outgoing(seq: int) -> Outgoing:
    """Message ``seq`` of the workload: every field a function of ``seq``; its
    properties carry ``seq`` so a consumer can check a message without the producer."""
    if seq % 11 == 0:
        return Outgoing(PLAIN, b"event %d " % seq + b"e" * (seq % 40), f"k{seq % KEYS}", "plain")
    if seq % 7 == 0:
        return Outgoing(COMPACTED, b"keyless %d " % seq + b"n" * (seq % 50), None, "keyless")
    if seq % 97 == 0:
        return Outgoing(COMPACTED, b"", f"k{seq % KEYS}", "tombstone")
    return Outgoing(COMPACTED, b"value %d " % seq + b"v" * (seq % 60), f"k{seq % KEYS}", "value")


def matches(message: Message, seq: int) -> bool:
    out = outgoing(seq)
    return (message.topic, message.body, message.key, message.tag, message.properties) == (
        out.topic,
        out.body,
        out.key,
        out.tag,
        {"seq": str(seq)},
    )


def send(store: MessageStore, seq: int) -> SendResult:
    out = outgoing(seq)
    return store.send(out.topic, out.body, key=out.key, tag=out.tag, properties={"seq": str(seq)})


class Producer(threading.Thread):
    def __init__(self, store: MessageStore, first: int) -> None:
        super().__init__(name="producer", daemon=True)
        self.store = store
        self.next_seq = first
        self.sent: dict[int, tuple[int, SendResult]] = {}  # position -> (seq, result)
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.paused = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.pause.is_set():
                    self.paused.set()
                    time.sleep(0.001)
                    continue
                self.paused.clear()
                result = send(self.store, self.next_seq)
                self.sent[result.position] = (self.next_seq, result)
                self.next_seq += 1
                time.sleep(0.001)
        except BaseException as exc:
            self.errors.append(exc)

    def wait_paused(self) -> None:
        self.pause.set()
        assert self.paused.wait(WAIT), "the producer did not pause"

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + WAIT
        while len(self.sent) < count and not self.errors:
            assert time.monotonic() < deadline, "the producer stalled"
            time.sleep(0.01)


class Consumer(threading.Thread):
    """Pulls every queue from offset 0 on and checks each message as it gets it."""

    def __init__(self, store: MessageStore) -> None:
        super().__init__(name="consumer", daemon=True)
        self.store = store
        self.seen: dict[int, Message] = {}
        self.stop = threading.Event()  # set once the producer stopped: drain, then end
        self.errors: list[BaseException] = []
        self.problems: list[str] = []
        self.pulls = 0

    def run(self) -> None:
        store = self.store
        queues = [(t, q) for t in (COMPACTED, PLAIN) for q in store.queue_ids(t)]
        offsets = dict.fromkeys(queues, 0)
        last = dict.fromkeys(queues, -1)
        try:
            while True:
                draining = self.stop.is_set()
                got = 0
                for queue in queues:
                    result = store.pull(*queue, offsets[queue], 64)
                    self.pulls += 1
                    for message in result.messages:
                        got += 1
                        self._check(message, queue, offsets[queue], last[queue])
                        last[queue] = message.queue_offset
                        self.seen[message.position] = message
                    if result.next_offset < offsets[queue]:
                        self.problems.append(f"{queue}: next offset went back")
                    offsets[queue] = result.next_offset
                if draining and not got:
                    return
                if not got:
                    time.sleep(0.002)
        except BaseException as exc:
            self.errors.append(exc)

    def _check(self, message: Message, queue: tuple[str, int], asked: int, last: int) -> None:
        seq = int(message.properties.get("seq", "-1"))
        if (message.topic, message.queue_id) != queue:
            self.problems.append(f"{queue}: got a message of {message.topic}/{message.queue_id}")
        if message.queue_offset <= last or message.queue_offset < asked:
            self.problems.append(f"{queue}: offset {message.queue_offset} after {last}")
        if not matches(message, seq):
            self.problems.append(f"{queue}: message at offset {message.queue_offset} is not {seq}")
        if message.position in self.seen:
            self.problems.append(f"{queue}: position {message.position} pulled twice")


@dataclass
class Live:
    path: Path
    store: MessageStore
    early: MessageStore  # read-only, opened after the pre-fill
    late: MessageStore  # read-only, opened right before the job
    early_last_chunk: int  # the number of the chunk that was ongoing when ``early`` opened
    early_known: int  # log position up to which ``early`` had seen records
    late_known: int
    report: CompactionReport
    snapshot: Snapshot
    removed: set[int]  # what the reference model says the job must remove
    sent: dict[int, tuple[int, SendResult]]  # every acknowledged send, by position
    consumer: Consumer
    final: dict[int, Message]  # pullable after the threads stopped


def _chunk_ranges(directory: Path) -> list[tuple[int, int, str]]:
    """(first number, last number, name) of every chunk file, read from its header."""
    found = []
    for entry in sorted(directory.iterdir()):
        if parse_chunk_file_name(entry.name) is None:
            continue
        with open(entry, "rb") as f:
            header = ChunkHeader.unpack(f.read(HEADER_SIZE), file=str(entry))
        found.append((header.chunk_start_number, header.chunk_end_number, entry.name))
    return found


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, spark: SparkSession) -> Iterator[Live]:
    path = tmp_path_factory.mktemp("compaction-live") / "store"
    store = MessageStore.open(path, CONFIG)
    producer = Producer(store, PREFILL)
    consumer = Consumer(store)
    opened: list[MessageStore] = [store]
    try:
        store.create_topic(COMPACTED, 2, cleanup="compact")
        store.create_topic(PLAIN, 1)
        for seq in range(PREFILL):
            result = send(store, seq)
            producer.sent[result.position] = (seq, result)
        store.flush()
        early = MessageStore.open(path, CONFIG, read_only=True)
        opened.append(early)
        early_last = early._messages.last_chunk
        assert early_last is not None and not early_last.is_completed
        early_known = early._messages.committed_position

        producer.start()
        consumer.start()
        # Two chunks past the early view's last one, then a checkpoint: that chunk is
        # completed and checkpointed, so the job may compact it.
        deadline = time.monotonic() + WAIT
        while _last_number(store) < early_last.start_number + 2:
            assert time.monotonic() < deadline and not producer.errors, producer.errors
            time.sleep(0.01)
        producer.wait_paused()
        store.flush()
        late = MessageStore.open(path, CONFIG, read_only=True)
        opened.append(late)
        late_known = late._messages.committed_position
        taken: list[tuple[Snapshot, set[int]]] = []
        real_snapshot = take_snapshot
        now = time.time()

        def snapshot_then_resume(store_path: str | Path) -> Snapshot:
            snapshot = real_snapshot(store_path)
            taken.append((snapshot, expected_removed(Path(store_path), now, snapshot=snapshot)))
            producer.pause.clear()
            # Pass 1 reads the chunks after the writer completed the snapshot's ongoing one.
            limit = time.monotonic() + WAIT
            while _last_number(store) <= snapshot.chunks[-1].start_number:
                assert time.monotonic() < limit and not producer.errors, producer.errors
                time.sleep(0.01)
            return snapshot

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(job, "take_snapshot", snapshot_then_resume)
            report = compact(path, spark=spark, now=now)
        [(snapshot, removed)] = taken
        # The running store adopts the replacements by itself (its service thread).
        deadline = time.monotonic() + WAIT
        while not any(c.header.compacted for c in store._messages):
            assert time.monotonic() < deadline, "the running store did not adopt the replacements"
            time.sleep(0.01)
        producer.wait_for(len(producer.sent) + MORE_AFTER_ADOPTION)
        _stop(producer, consumer)
        assert producer.errors == [] and consumer.errors == [], (producer.errors, consumer.errors)
        yield Live(
            path,
            store,
            early,
            late,
            early_last.start_number,
            early_known,
            late_known,
            report,
            snapshot,
            removed,
            dict(producer.sent),
            consumer,
            all_messages(store),
        )
    finally:
        _stop(producer, consumer)
        for handle in reversed(opened):
            handle.close()


def _last_number(store: MessageStore) -> int:
    last = store._messages.last_chunk
    assert last is not None
    return last.start_number


def _stop(producer: Producer, consumer: Consumer) -> None:
    producer.stop.set()
    if producer.is_alive():
        producer.join(WAIT)
    consumer.stop.set()  # the consumer drains what the producer sent, then ends
    if consumer.is_alive():
        consumer.join(WAIT)
    assert not producer.is_alive() and not consumer.is_alive()


def test_the_job_compacted_while_the_producer_ran(live: Live) -> None:
    """The scenario did what it is meant to: merges, removals, sends during the job."""
    assert live.removed and live.report.records_removed >= len(live.removed)
    assert any(g.end_number > g.start_number for g in live.report.groups)  # a merge
    rewritten = {n for g in live.report.groups for n in range(g.start_number, g.end_number + 1)}
    assert live.early_last_chunk in rewritten
    ongoing = live.snapshot.chunks[-1]
    assert ongoing.start_number not in rewritten
    assert max(live.sent) > ongoing.start_number * CONFIG.layout.chunk_data_size + ongoing.data_end
    assert live.consumer.pulls > 0


def test_the_job_removed_exactly_what_the_model_says(live: Live) -> None:
    assert live.sent.keys() - live.final.keys() == live.removed
    assert live.report.records_removed == len(live.removed)


def test_nothing_lost_nothing_corrupt(live: Live) -> None:
    sent, final = live.sent, live.final
    gone = sent.keys() - final.keys()
    # Everything the policy removes is gone, and whatever is gone was superseded: a newer
    # message with its key is pullable, and it lay in a chunk the job rewrote.
    assert live.removed <= gone
    rewritten = {n for g in live.report.groups for n in range(g.start_number, g.end_number + 1)}
    newest: dict[tuple[str, str], int] = {}
    for position, (seq, _) in sent.items():
        out = outgoing(seq)
        if out.key is not None:
            newest[(out.topic, out.key)] = max(newest.get((out.topic, out.key), -1), position)
    for position in gone:
        out = outgoing(sent[position][0])
        assert out.topic == COMPACTED and out.key is not None, (position, out)
        assert position // CONFIG.layout.chunk_data_size in rewritten, position
        assert newest[(out.topic, out.key)] > position
    # Every key's newest message survives.
    assert len(newest) == 2 * KEYS and all(p in final for p in newest.values())
    # Nothing corrupt: each survivor is exactly what was sent, where it was sent.
    for position, message in final.items():
        seq, result = sent[position]
        assert matches(message, seq), (position, seq, message)
        assert (message.message_id, message.queue_id, message.queue_offset) == (
            result.message_id,
            result.queue_id,
            result.queue_offset,
        )
    # What the consumer pulled while it all ran: every survivor, and nothing else but
    # messages the job removed (it may have got them before their removal).
    consumer = live.consumer
    assert consumer.problems == []
    assert consumer.seen.keys() >= final.keys()
    assert consumer.seen.keys() - final.keys() <= gone
    for position, message in consumer.seen.items():
        assert matches(message, sent[position][0])


def test_running_store_adopted_the_replacements_and_dropped_the_old_files(live: Live) -> None:
    store = live.store
    chunks = list(store._messages)
    compacted = {c.path.name for c in chunks if c.header.compacted}
    assert compacted == {g.file_name for g in live.report.groups}
    # One file per chunk number: every file the store has, and only those.
    ranges = _chunk_ranges(live.path / MESSAGES_DIR)
    assert [name for _, _, name in ranges] == [c.path.name for c in chunks]
    for (_, end, _), (start, _, _) in itertools.pairwise(ranges):
        assert start == end + 1
    # Neither a mapping nor a descriptor of a deleted chunk file is held (the read-only
    # views never read before the job, and have not read since).
    gc.collect()
    messages = str(live.path / MESSAGES_DIR)
    with open("/proc/self/maps") as maps:
        held = [line for line in maps if messages in line and "(deleted)" in line]
    assert held == []
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    assert [t for t in fds if t.startswith(messages) and t.endswith("(deleted)")] == []


def test_removed_positions_read_as_compacted_away(live: Live) -> None:
    store = live.store
    for position in sorted(live.removed)[:: max(1, len(live.removed) // 50)]:
        with pytest.raises(CompactedAwayError) as raised:
            store.read(position)
        assert not isinstance(raised.value, MessageNotFoundError)
        with pytest.raises(CompactedAwayError):
            store.get(live.sent[position][1].message_id)
    for position in list(live.final)[:: max(1, len(live.final) // 50)]:
        assert store.read(position) == live.final[position]
    # A position that never held a message is another error.
    with pytest.raises(MessageNotFoundError):
        store.read(store._messages.committed_position + 4096)
    ongoing = max(live.final)
    with pytest.raises(MessageNotFoundError):
        store.read(ongoing + 1)  # inside a record of a chunk never compacted


def test_query_by_key_returns_only_survivors(live: Live) -> None:
    by_key: dict[tuple[str, str], list[int]] = {}
    for position, message in live.final.items():
        if message.key is not None:
            by_key.setdefault((message.topic, message.key), []).append(position)
    assert len(by_key) == 2 * KEYS
    for (topic, key), positions in by_key.items():
        found = live.store.query_by_key(topic, key, limit=100_000)
        assert [m.position for m in found] == sorted(positions, reverse=True), (topic, key)
        assert all(m == live.final[m.position] for m in found)


def test_read_only_view_adopts_the_replacements_when_it_reads(live: Live) -> None:
    """The late view's chunks were all completed when it opened: reading a moved record
    finds its old file gone, adopts the replacements, and reads on."""
    late = live.late
    known = {p: m for p, m in live.final.items() if p < live.late_known}
    assert not any(c.header.compacted for c in late._messages)
    for position, message in known.items():
        assert late.read(position) == message
    assert {c.path.name for c in late._messages if c.header.compacted} == {
        g.file_name for g in live.report.groups
    }
    for position in live.removed:
        with pytest.raises(CompactedAwayError):
            late.read(position)
    late.refresh()
    assert all_messages(late) == live.final


def test_read_only_view_opened_before_keeps_reading(live: Live) -> None:
    early = live.early
    known = {p: m for p, m in live.final.items() if p < live.early_known}
    in_last = [p for p in known if p // CONFIG.layout.chunk_data_size == live.early_last_chunk]
    assert in_last  # survivors in the chunk that was ongoing when the view opened
    pulled: dict[int, Message] = {}
    for topic in early.topics():
        for queue_id in early.queue_ids(topic):
            stop = early.queue_range(topic, queue_id)[1]
            offset = 0
            while offset < stop:
                result = early.pull(topic, queue_id, offset, min(256, stop - offset))
                pulled.update(
                    (m.position, m) for m in result.messages if m.position < live.early_known
                )
                offset = result.next_offset
    assert {p: m for p, m in pulled.items() if p not in live.removed} == known
    for position in in_last:
        assert early.read(position) == known[position]
    early.refresh()
    assert all_messages(early) == live.final


def test_reopen_shows_the_same_and_verify_is_clean(live: Live) -> None:
    """Last: closes the store and the views."""
    live.early.close()
    live.late.close()
    live.store.close()
    with MessageStore.open(live.path) as store:
        assert store.recovery.clean, store.recovery
        assert all_messages(store) == live.final
        assert {c.path.name for c in store._messages if c.header.compacted} == {
            g.file_name for g in live.report.groups
        }
    assert Verifier(live.path).run() == []
