"""The consumer loop (issue 21): ``store.consumer(group, topics)`` on writer and
read-only handles, in this process and in others (tests/consumer_child.py), killed and
resumed; its commits as every handle, retention and the inspector see them; and the
group files of ``consumers/`` damaged or replaced by links."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from store_helpers import pull_all, settle_chunk_maker, snapshot

from equeue import Message, MessageStore, StoreConfig
from equeue.cli import main as cli_main
from equeue.errors import (
    ClosedError,
    CorruptionError,
    EQueueError,
    InvalidMessageError,
    InvalidTypeError,
    StorePathError,
    TopicNotFoundError,
)
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE
from equeue.store.offsets import file_name

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CHILD = Path(__file__).with_name("consumer_child.py")
SMALL = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, queue_chunk_records=342)
DAY = dt.timedelta(days=1)
LATER = time.time() + 2 * 86400  # retention's "now": every completed chunk has expired
BOUNDED = 60.0  # seconds: a bound on waits that normally take milliseconds, never asserted


def body(queue_id: int, offset: int) -> bytes:
    return f"t/{queue_id}/{offset}".encode()


def send_to(store: MessageStore, queue_id: int, count: int, tag: str = "") -> None:
    """``count`` messages to queue ``queue_id`` of ``t``, each body naming its place."""
    for _ in range(count):
        offset = store.queue_range("t", queue_id)[1]
        store.send("t", body(queue_id, offset), tag=tag, queue_id=queue_id)


def places(messages: list[Message]) -> list[tuple[int, int]]:
    return [(m.queue_id, m.queue_offset) for m in messages]


def ends(store: MessageStore) -> dict[int, int]:
    return {q: store.queue_range("t", q)[1] for q in store.queue_ids("t")}


def group_offsets(store: MessageStore, group: str) -> dict[int, int]:
    return store.consumer_groups().get(group, {}).get("t", {})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "s", SMALL) as opened:
        opened.create_topic("t", 4)
        yield opened


# --- the loop ----------------------------------------------------------------------------


def test_fair_between_queues_and_in_order_within_each(store: MessageStore) -> None:
    send_to(store, 0, 300)
    for queue_id in (1, 2, 3):
        send_to(store, queue_id, 12)
    with store.consumer("g", "t", batch_size=8, timeout=0) as consumer:
        got = places(list(consumer))
    assert sorted(got) == sorted(
        [(0, o) for o in range(300)] + [(q, o) for q in (1, 2, 3) for o in range(12)]
    )
    for queue_id in range(4):
        offsets = [o for q, o in got if q == queue_id]
        assert offsets == sorted(offsets)
    # Fair: each batch of 8 takes 2 from each queue that has messages, so the small
    # queues are done within their 6th batch, not after the 300 of queue 0.
    last_small = max(i for i, (q, _) in enumerate(got) if q != 0)
    assert last_small < 6 * 8
    assert all({q for q, _ in got[i : i + 8]} == {0, 1, 2, 3} for i in range(0, 40, 8))
    assert group_offsets(store, "g") == {0: 300, 1: 12, 2: 12, 3: 12}


def test_topics_listed_are_all_consumed(store: MessageStore) -> None:
    store.create_topic("u", 1)
    send_to(store, 0, 3)
    store.send("u", b"u0")
    with store.consumer("g", ["t", "u"], timeout=0) as consumer:
        got = [(m.topic, m.queue_offset) for m in consumer]
    assert sorted(got) == [("t", 0), ("t", 1), ("t", 2), ("u", 0)]
    assert store.committed_offset("g", "u", 0) == 1


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
def test_blocks_until_a_message_arrives_and_times_out(store: MessageStore, read_only: bool) -> None:
    handle = MessageStore.open(store.path, read_only=True) if read_only else store
    try:
        consumer = handle.consumer("g", "t", tags="wanted")
        assert consumer.poll(timeout=0) == []  # the control: nothing there yet
        assert consumer.poll(timeout=0.05) == []  # returns once the time passed
        with handle.consumer("g", "t", timeout=0.05) as idle:
            assert list(idle) == []  # the iteration ends after `timeout` without messages

        def send_later() -> None:
            time.sleep(0.1)
            store.send("t", b"other", tag="other", queue_id=1)  # wakes it, does not match
            time.sleep(0.1)
            store.send("t", b"wanted", tag="wanted", queue_id=2)

        sender = threading.Thread(target=send_later)
        sender.start()
        got = consumer.poll(timeout=BOUNDED)  # a bounded wait: returns when it arrives
        sender.join()
        assert [m.body for m in got] == [b"wanted"]
        consumer.close()
        assert group_offsets(store, "g") == {0: 0, 1: 1, 2: 1, 3: 0}
    finally:
        if read_only:
            handle.close()


def test_iteration_blocks_for_new_messages(store: MessageStore) -> None:
    """``for message in consumer`` without a timeout waits for what is sent later."""
    received: list[bytes] = []

    def consume() -> None:
        with store.consumer("g", "t") as consumer:
            for message in consumer:
                received.append(message.body)
                if len(received) == 5:
                    break

    thread = threading.Thread(target=consume)
    thread.start()
    for i in range(5):
        time.sleep(0.02)
        store.send("t", b"%d" % i, queue_id=i % 4)
    thread.join(BOUNDED)
    assert not thread.is_alive()
    assert sorted(received) == [b"0", b"1", b"2", b"3", b"4"]
    assert sum(group_offsets(store, "g").values()) == 5  # break, then close: all 5 done


def test_tags(store: MessageStore) -> None:
    for i in range(40):
        store.send("t", b"%d" % i, tag="abc"[i % 3], queue_id=i % 4)
    with store.consumer("g", "t", tags=["a", "c"], timeout=0) as consumer:
        got = list(consumer)
    assert sorted(int(m.body) for m in got) == [i for i in range(40) if i % 3 != 1]
    assert {m.tag for m in got} == {"a", "c"}
    assert group_offsets(store, "g") == {0: 10, 1: 10, 2: 10, 3: 10}  # past the "b"s too
    with store.consumer("h", "t", tags="none-such", timeout=0) as consumer:
        assert list(consumer) == []
    assert group_offsets(store, "h") == {0: 10, 1: 10, 2: 10, 3: 10}


def test_start_modes(store: MessageStore) -> None:
    send_to(store, 0, 10)
    store.commit_offset("g", "t", 0, 6)
    with store.consumer("g", "t", timeout=0) as consumer:
        assert places(list(consumer)) == [(0, o) for o in range(6, 10)]
    with store.consumer("new", "t", timeout=0) as consumer:  # no commit: from the first
        assert places(list(consumer)) == [(0, o) for o in range(10)]
    store.commit_offset("g", "t", 0, 6)
    with store.consumer("g", "t", start="earliest", timeout=0) as consumer:
        assert places(consumer.poll(3)) == [(0, 0), (0, 1), (0, 2)]
    assert store.committed_offset("g", "t", 0) == 6  # a consumer's commit never moves back
    latest = store.consumer("g", "t", start="latest", timeout=0)
    assert list(latest) == []
    send_to(store, 3, 2)
    assert places(list(latest)) == [(3, 0), (3, 1)]
    latest.close()
    # queue 0's 6..9 were never read for g: "latest" passed them, so it does not commit
    # queue 0 (review 38e E13: it committed 10, and g lost them); the queues g had not
    # committed start where "latest" put them
    assert group_offsets(store, "g") == {0: 6, 1: 0, 2: 0, 3: 2}


def test_latest_never_commits_over_a_groups_backlog(
    store: MessageStore, caplog: pytest.LogCaptureFixture
) -> None:
    send_to(store, 0, 20)
    store.commit_offset("billing", "t", 0, 10)
    with store.consumer("billing", "t", start="latest", timeout=0.1) as watcher:
        assert list(watcher) == []
        send_to(store, 0, 2)
        assert places(list(watcher)) == [(0, 20), (0, 21)]
    assert store.committed_offset("billing", "t", 0) == 10  # its backlog is still there
    assert "t/0 offsets 10..19" in caplog.text
    with store.consumer("billing", "t", timeout=0) as billing:
        assert places(list(billing)) == [(0, o) for o in range(10, 22)]
    assert store.committed_offset("billing", "t", 0) == 22
    # the control: no backlog (committed at the end), "latest" commits as it reads
    caplog.clear()
    with store.consumer("billing", "t", start="latest", timeout=0) as watcher:
        send_to(store, 0, 1)
        assert places(list(watcher)) == [(0, 22)]
    assert store.committed_offset("billing", "t", 0) == 23
    assert "has not committed" not in caplog.text


def test_a_start_over_offsets_retention_removed_commits_as_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # review3 R1: the rule above took offsets retention had removed for a backlog, and
    # "earliest" (whose start is never past the commit by choice) stopped committing
    config = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, retention=dt.timedelta(seconds=1))
    with MessageStore.open(tmp_path / "s", config) as store:
        store.create_topic("t", 1)
        for _ in range(60):
            store.send("t", b"f" * 900)
        store.commit_offset("g", "t", 0, 5)
        store.apply_retention(now=time.time() + 60)
        first, end = store.queue_range("t", 0)
        assert first > 5
        with store.consumer("g", "t", start="earliest", timeout=0) as consumer:
            assert len(list(consumer)) == end - first
        assert store.committed_offset("g", "t", 0) == end
        assert "has not committed" not in caplog.text
        # "latest" passes first..end-1, which g can still read: those, not 5.., are named
        store.commit_offset("g", "t", 0, 5)
        with store.consumer("g", "t", start="latest", timeout=0) as consumer:
            assert list(consumer) == []
        assert store.committed_offset("g", "t", 0) == 5
        assert f"t/0 offsets {first}..{end - 1}" in caplog.text


def test_an_offset_committed_past_the_end_starts_at_the_end(store: MessageStore) -> None:
    send_to(store, 0, 3)
    with store.consumer("g", "t") as consumer:
        consumer.poll()
    store._offsets = {"g": {"t": {"0": 50}}}  # as an older equeue let commit_offset write
    with store.consumer("g", "t", timeout=0) as consumer:
        assert list(consumer) == []
        send_to(store, 0, 1)
        assert places(list(consumer)) == [(0, 3)]  # not skipped: the queue's end was 3


def test_a_queue_the_topic_gains_is_consumed_from_its_start(store: MessageStore) -> None:
    consumer = store.consumer("g", "t", start="latest", timeout=0)
    store.create_topic("t", 5)
    send_to(store, 4, 2)
    assert places(list(consumer)) == [(4, 0), (4, 1)]
    consumer.close()


def test_auto_commit_after_each_batch(store: MessageStore) -> None:
    send_to(store, 0, 10)
    committed = []
    with store.consumer("g", "t", batch_size=4, timeout=0) as consumer:
        for message in consumer:
            committed.append(store.committed_offset("g", "t", 0))
            del message
    # Batches [0..3], [4..7], [8, 9]: each committed once the next is fetched (before
    # the first, where the group starts).
    assert committed == [0] * 4 + [4] * 4 + [8] * 2
    assert store.committed_offset("g", "t", 0) == 10


def test_manual_commit(store: MessageStore) -> None:
    send_to(store, 0, 10)
    with store.consumer("g", "t", batch_size=4, auto_commit=False, timeout=0) as consumer:
        for message in consumer:
            if message.queue_offset == 5:
                consumer.commit()  # everything handed out: 0..5
                assert store.committed_offset("g", "t", 0) == 6
    assert store.committed_offset("g", "t", 0) == 6  # close() commits nothing by itself


def test_poll_commits_the_previous_batch(store: MessageStore) -> None:
    send_to(store, 0, 10)
    consumer = store.consumer("g", "t")
    assert len(consumer.poll(4)) == 4
    assert store.committed_offset("g", "t", 0) == 0  # in hand: not processed yet
    assert len(consumer.poll(4)) == 4
    assert store.committed_offset("g", "t", 0) == 4
    consumer.close()
    assert store.committed_offset("g", "t", 0) == 8
    with pytest.raises(ClosedError):
        consumer.poll()


def test_close_commits_what_was_processed(store: MessageStore) -> None:
    send_to(store, 0, 10)
    with store.consumer("g", "t", batch_size=32) as consumer:
        for message in consumer:
            if message.queue_offset == 2:
                break
    assert store.committed_offset("g", "t", 0) == 3  # left normally: 0, 1, 2 processed
    with pytest.raises(RuntimeError), store.consumer("g", "t", batch_size=32) as consumer:
        for message in consumer:
            if message.queue_offset == 5:
                raise RuntimeError("processing failed")
    assert store.committed_offset("g", "t", 0) == 5  # 5 was in hand: it comes again
    with store.consumer("g", "t", timeout=0) as consumer:
        assert places(list(consumer))[0] == (0, 5)


def test_bad_arguments_raise_equeue_errors(store: MessageStore) -> None:
    settle_chunk_maker(store)  # the log's next file is made ahead after the open
    before = snapshot(store.path)
    cases: list[tuple[dict[str, Any], type[EQueueError]]] = [
        ({"group": ""}, InvalidMessageError),
        ({"group": 5}, InvalidMessageError),
        ({"group": "\ud800"}, InvalidMessageError),
        ({"group": "g" * 256}, InvalidMessageError),
        ({"topics": []}, InvalidMessageError),
        ({"topics": 5}, InvalidTypeError),
        ({"topics": "nope"}, TopicNotFoundError),
        ({"topics": "../x"}, InvalidMessageError),
        ({"start": "now"}, InvalidMessageError),
        ({"tags": 5}, InvalidTypeError),
        ({"tags": [5]}, InvalidTypeError),
        ({"batch_size": 0}, InvalidMessageError),
        ({"batch_size": 2.5}, InvalidTypeError),
        ({"timeout": -1}, InvalidMessageError),
        ({"timeout": float("nan")}, InvalidMessageError),
        ({"timeout": "1"}, InvalidTypeError),
        ({"auto_commit": "yes"}, InvalidTypeError),
    ]
    for change, error in cases:
        arguments: dict[str, Any] = {"group": "g", "topics": "t"} | change
        with pytest.raises(error):
            store.consumer(**arguments)
    consumer = store.consumer("g", "t")
    with pytest.raises(InvalidMessageError):
        consumer.poll(0)
    with pytest.raises(InvalidTypeError):
        consumer.poll(1, timeout="soon")  # type: ignore[arg-type]
    assert snapshot(store.path) == before
    consumer.close()


# --- read-only handles and other processes ------------------------------------------------


def test_read_only_commits_are_seen_by_every_handle(store: MessageStore) -> None:
    send_to(store, 0, 5)
    send_to(store, 1, 3)
    with MessageStore.open(store.path, read_only=True) as reader:
        with reader.consumer("g", "t", timeout=0) as consumer:
            assert len(list(consumer)) == 8
        # The writer and the reader see the read-only consumer's commits at once.
        assert group_offsets(store, "g") == {0: 5, 1: 3, 2: 0, 3: 0}
        assert group_offsets(reader, "g") == {0: 5, 1: 3, 2: 0, 3: 0}
        assert store.committed_offset("g", "t", 1) == 3
        assert (store.path / CONSUMERS_DIR / "g.json").is_file()
        # The writer resets the group below what the read-only consumer committed.
        store.commit_offset("g", "t", 0, 2)
        assert store.committed_offset("g", "t", 0) == 2
        assert reader.committed_offset("g", "t", 0) == 2
        with reader.consumer("g", "t", timeout=0) as consumer:
            assert places(list(consumer)) == [(0, 2), (0, 3), (0, 4)]
        send_to(store, 2, 1)
        with store.consumer("g", "t", timeout=0) as consumer:  # the writer's, after both
            assert places(list(consumer)) == [(2, 0)]
    with MessageStore.open(store.path, read_only=True) as fresh:
        assert group_offsets(fresh, "g") == {0: 5, 1: 3, 2: 1, 3: 0}


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
def test_two_consumers_of_a_group_never_move_its_offset_back(
    store: MessageStore, read_only: bool
) -> None:
    """The farther consumer's commit wins, whichever commits last."""
    send_to(store, 0, 10)
    handles = [MessageStore.open(store.path, read_only=True) for _ in range(2)]
    try:
        owners = handles if read_only else [store, store]
        ahead, behind = (owner.consumer("g", "t") for owner in owners)
        assert len(ahead.poll(8)) == 8 and len(behind.poll(3)) == 3
        ahead.close()
        assert store.committed_offset("g", "t", 0) == 8
        behind.close()  # commits 3 after the other's 8
        assert store.committed_offset("g", "t", 0) == 8
        assert handles[0].committed_offset("g", "t", 0) == 8
    finally:
        for handle in handles:
            handle.close()


def test_group_names_of_any_kind_get_their_own_file(store: MessageStore) -> None:
    send_to(store, 0, 1)
    names = ["a/b", "..", ".hidden", "ünï cødé", "%%", "x" * 255, "é" * 127]
    with MessageStore.open(store.path, read_only=True) as reader:
        for group in names:
            with reader.consumer(group, "t", timeout=0) as consumer:
                assert len(list(consumer)) == 1
    files = sorted(os.listdir(store.path / CONSUMERS_DIR))
    assert files == sorted(file_name(group) for group in names)
    assert all("/" not in name and len(name.encode()) < 255 for name in files)
    assert {g for g in store.consumer_groups()} == set(names)
    assert store.recovery.problems == []


class Child:
    """tests/consumer_child.py: a read-only consumer in another process."""

    def __init__(self, path: Path, group: str, out: Path, batch: int, idle: float, delay: float):
        self.out = out
        arguments = [str(path), group, str(out), str(batch), str(idle), str(delay)]
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), *arguments],
            stdout=subprocess.PIPE,
            text=True,
        )

    def lines(self) -> list[tuple[int, int]]:
        if not self.out.exists():
            return []
        return [
            (int(q), int(o))
            for q, o in (line.split() for line in self.out.read_text().split("\n") if line)
        ]

    def kill_after(self, count: int) -> None:
        """SIGKILL once it processed ``count`` messages (or ended)."""
        deadline = time.monotonic() + BOUNDED
        while len(self.lines()) < count and self.process.poll() is None:
            assert time.monotonic() < deadline, "the consumer process made no progress"
            time.sleep(0.005)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(BOUNDED)

    def finish(self) -> None:
        assert self.process.wait(BOUNDED) == 0
        assert self.process.stdout is not None and self.process.stdout.read() == "done\n"


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def test_consumer_in_another_process_while_the_writer_sends(
    store: MessageStore, tmp_path: Path, children: list[Child]
) -> None:
    child = Child(store.path, "g", tmp_path / "out", batch=16, idle=2.0, delay=0.0)
    children.append(child)
    for _ in range(50):
        for queue_id in range(4):
            send_to(store, queue_id, 5)
        time.sleep(0.002)
    child.finish()
    got = child.lines()
    assert sorted(got) == [(q, o) for q in range(4) for o in range(250)]  # each once
    assert group_offsets(store, "g") == {q: 250 for q in range(4)}  # seen by the writer
    with store.consumer("g", "t", timeout=0) as again:  # and by a new consumer of the group
        assert list(again) == []


@pytest.mark.parametrize("kills", [3])
def test_killed_consumer_resumes_without_loss(
    store: MessageStore, tmp_path: Path, children: list[Child], kills: int
) -> None:
    """A consumer process SIGKILLed mid-stream, three times, and restarted: every message
    is consumed; a restart repeats only what the killed one processed after its last
    commit, at most one batch; group ``other``, consuming beside it, is independent."""
    batch = 16
    done = threading.Event()

    def produce() -> None:
        for _ in range(60):
            for queue_id in range(4):
                send_to(store, queue_id, 5)
            time.sleep(0.005)
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        other = Child(store.path, "other", tmp_path / "other", batch=7, idle=2.0, delay=0.0)
        children.append(other)
        runs: list[list[tuple[int, int]]] = []
        for run in range(kills):
            child = Child(store.path, "g", tmp_path / f"run{run}", batch, idle=5.0, delay=0.002)
            children.append(child)
            child.kill_after(40 + 37 * run)  # mid-batch: neither 16 nor the commits divide it
            runs.append(child.lines())
    finally:
        producer.join()
    assert done.is_set()
    last = Child(store.path, "g", tmp_path / "last", batch, idle=1.0, delay=0.0)
    children.append(last)
    last.finish()
    runs.append(last.lines())
    total = 60 * 5
    everything = [(q, o) for q in range(4) for o in range(total)]
    assert sorted(set().union(*map(set, runs))) == everything  # nothing lost
    seen: set[tuple[int, int]] = set()
    for number, lines in enumerate(runs):
        for queue_id in range(4):  # in order within each queue, in each run
            offsets = [o for q, o in lines if q == queue_id]
            assert offsets == sorted(set(offsets))
        repeated = [place for place in lines if place in seen]
        if number == 0:
            assert repeated == []
        # What a restart repeats: what the killed run processed after its last commit.
        assert len(repeated) <= batch, (number, repeated)
        per_queue = Counter(q for q, _ in repeated)
        assert all(count <= batch for count in per_queue.values())
        seen.update(lines)
    assert any(runs[:kills])  # the kills landed after some progress
    assert group_offsets(store, "g") == {q: total for q in range(4)}
    other.finish()
    assert sorted(other.lines()) == everything  # the other group got everything, once
    assert group_offsets(store, "other") == {q: total for q in range(4)}


# --- compaction, retention -------------------------------------------------------------


@pytest.mark.parametrize("read_only", [False, True], ids=["writer", "read-only"])
def test_retention_under_the_consumer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, read_only: bool
) -> None:
    """Retention removes messages the group has not consumed: the consumer goes on at
    the queue's new first offset, counts what it missed in ``skipped`` and logs it."""
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE, queue_chunk_records=342, retention=DAY
    )
    with (
        MessageStore.open(tmp_path / "s", config) as store,
        MessageStore.open(store.path, read_only=True) as reader,
    ):
        store.create_topic("t", 1)
        send_to(store, 0, 20)
        handle = reader if read_only else store
        consumer = handle.consumer("g", "t", batch_size=4)
        assert places(consumer.poll()) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        consumer.commit()
        send_to(store, 0, 200)
        assert places(consumer.poll()) == [(0, 4), (0, 5), (0, 6), (0, 7)]
        assert consumer.skipped == {}  # the control: nothing removed yet
        assert store.apply_retention(LATER) > 0
        first = store.queue_range("t", 0)[0]
        assert first > 8
        # A reader's pulls look for removed chunks every 10 ms, and meanwhile read what
        # their mappings still hold: refresh() looks now.
        handle.refresh()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "equeue.consumer"):
            got = consumer.poll()
        assert places(got) == [(0, first + i) for i in range(4)]
        assert consumer.skipped == {("t", 0): first - 8}
        assert f"retention removed offsets 8..{first - 1} of t/0" in caplog.text
        consumer.close()
        assert store.committed_offset("g", "t", 0) == first + 4


def test_retention_respects_read_only_consumers(tmp_path: Path) -> None:
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE,
        queue_chunk_records=342,
        retention=DAY,
        retention_respects_consumers=True,
    )
    with MessageStore.open(tmp_path / "s", config) as store:
        store.create_topic("t", 1)
        send_to(store, 0, 20)
        with MessageStore.open(store.path, read_only=True) as reader:
            with reader.consumer("g", "t", batch_size=4) as consumer:
                consumer.poll()
                consumer.commit()
            send_to(store, 0, 200)
            assert store.apply_retention(LATER) == 0  # held back by the group at offset 4
            assert store.queue_range("t", 0)[0] == 0
            with reader.consumer("g", "t", timeout=0) as consumer:
                assert len(list(consumer)) == 216
            assert store.apply_retention(LATER) > 0  # the control: consumed, it goes


def test_consumer_on_a_compacted_store(tmp_path: Path, spark: SparkSession) -> None:
    """The consumer hands out what compaction left, in order, and passes the offsets it
    removed."""
    from equeue.compaction.job import compact

    with MessageStore.open(tmp_path / "s", SMALL) as store:
        store.create_topic("t", 2, cleanup="compact")
        for i in range(300):
            store.send("t", b"%d" % i, key=f"k{i % 7}", queue_id=i % 2)
        store.flush()
    assert compact(tmp_path / "s", spark=spark).records_removed > 0
    with MessageStore.open(tmp_path / "s") as store:
        expected = pull_all(store)
        assert sum(map(len, expected.values())) < 300  # the control: compaction removed some
        for handle in (store, MessageStore.open(store.path, read_only=True)):
            with handle.consumer(f"g{handle.read_only}", "t", batch_size=5, timeout=0) as c:
                got = list(c)
            for queue_id in (0, 1):
                assert [m for m in got if m.queue_id == queue_id] == expected[("t", queue_id)]
            assert group_offsets(store, f"g{handle.read_only}") == {0: 150, 1: 150}
            if handle.read_only:
                handle.close()


# --- hostile and damaged group files --------------------------------------------------------


def _consume_all(handle: MessageStore, group: str) -> int:
    with handle.consumer(group, "t", timeout=0) as consumer:
        return len(list(consumer))


def test_undamaged_group_files_report_nothing(store: MessageStore, capsys: Any) -> None:
    """The control of the hostile cases; also the temp files a killed commit leaves: ignored,
    and removed by a writable open once a minute old."""
    send_to(store, 0, 3)
    with MessageStore.open(store.path, read_only=True) as reader:
        assert _consume_all(reader, "g") == 3
    store.close()
    fresh, stale = (store.path / CONSUMERS_DIR / f"g.json.{n}.tmp" for n in ("1a", "2b"))
    fresh.write_bytes(b'{"xxh64": "torn')
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 120, time.time() - 120))
    with MessageStore.open(store.path) as reopened:
        assert reopened.recovery.problems == []
        assert group_offsets(reopened, "g") == {0: 3, 1: 0, 2: 0, 3: 0}
    assert fresh.exists() and not stale.exists()
    assert cli_main(["verify", str(store.path)]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", "--json", str(store.path)]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert {(g["queue_id"], g["committed_offset"], g["lag"]) for g in groups} == {
        (0, 3, 0),
        (1, 0, 0),
        (2, 0, 0),
        (3, 0, 0),
    }


def _plant(kind: str, store_path: Path, outside: Path) -> Path:
    """Damage ``consumers/g.json`` (or the directory) as ``kind`` says; returns the path."""
    directory = store_path / CONSUMERS_DIR
    target = directory / "g.json"
    if kind == "flipped":
        raw = bytearray(target.read_bytes())
        raw[raw.index(b'"0": 5') + 5] ^= 0x01  # offset 5 reads 4: valid JSON, bad checksum
        target.write_bytes(bytes(raw))
    elif kind == "truncated":
        target.write_bytes(target.read_bytes()[:20])
    elif kind == "link":  # to a valid group file: read through the link, it would count
        target.replace(outside)
        target.symlink_to(outside)
    elif kind == "directory":
        target.unlink()
        target.mkdir()
    elif kind == "huge":  # a sparse 1 GiB file: refused by its size, never read whole
        with open(target, "r+b") as f:
            f.truncate(1 << 30)
    elif kind == "renamed":  # a valid file of group g under another group's name
        target.rename(directory / "h.json")
        return directory / "h.json"
    elif kind == "dir-link":  # to a directory holding a valid group file
        target.replace(outside.parent / "g.json")
        directory.rmdir()
        directory.symlink_to(outside.parent)
        return directory
    return target


HOSTILE = ["flipped", "truncated", "link", "directory", "huge", "renamed", "dir-link"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_group_file(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged group file, one of another group, a link or a directory in its place:
    read-only handles report it and ignore it, a commit onto it raises CorruptionError
    naming it, ``equeue verify`` exits 1, a writable open moves it to
    ``consumers/recovered/`` and reports it; nothing outside the store changes."""
    outside = tmp_path / "outside" / "victim.json"
    outside.parent.mkdir()
    outside.write_text("not the store's")
    path = tmp_path / "s"
    with MessageStore.open(path, SMALL) as store:
        store.create_topic("t", 1)
        send_to(store, 0, 5)
    with MessageStore.open(path, read_only=True) as reader:
        assert _consume_all(reader, "g") == 5
    planted = _plant(kind, path, outside)
    outside_before = snapshot(outside.parent)
    if kind == "dir-link":  # as every store directory: refused by every open (safepath)
        for read_only in (True, False):
            with pytest.raises(StorePathError, match=str(planted)):
                MessageStore.open(path, read_only=read_only)
        assert cli_main(["verify", str(path)]) == 1
        assert str(planted) in capsys.readouterr().err  # one error line, as for every path
        assert snapshot(outside.parent) == outside_before
        return
    with MessageStore.open(path, read_only=True) as reader:
        assert reader.committed_offset("g", "t", 0) is None  # ignored: not read as offsets
        assert reader.committed_offset("h", "t", 0) is None
        if kind == "renamed":  # g has no file now: it starts over, and has one again
            assert _consume_all(reader, "g") == 5
            assert reader.consumer_groups() == {"g": {"t": {0: 5}}}
        else:
            with pytest.raises(CorruptionError, match=str(planted)):
                _consume_all(reader, "g")
            assert reader.consumer_groups() == {}
    assert cli_main(["verify", str(path)]) == 1
    assert str(planted) in capsys.readouterr().out
    with MessageStore.open(path) as store:
        assert any(str(planted) in p and "moved to" in p for p in store.recovery.problems), (
            store.recovery.problems
        )
        assert not os.path.lexists(planted)
        assert len(os.listdir(path / CONSUMERS_DIR / "recovered")) == 1
        with MessageStore.open(path, read_only=True) as reader:
            assert _consume_all(reader, "g") == (0 if kind == "renamed" else 5)
        assert store.committed_offset("g", "t", 0) == 5
        store.commit_offset("g", "t", 0, 1)  # the writer's commit is never refused
        assert store.committed_offset("g", "t", 0) == 1
    assert snapshot(outside.parent) == outside_before


def test_consumers_commit_to_their_group_file_only(store: MessageStore) -> None:
    """offsets.json is commit_offset's: a consumer, on the writer's handle or a read-only
    one, commits to consumers/GROUP.json (off the send lock)."""
    send_to(store, 0, 2)
    store.commit_offset("w", "t", 0, 1)
    before = (store.path / OFFSETS_FILE).read_bytes()
    assert _consume_all(store, "g") == 2
    with MessageStore.open(store.path, read_only=True) as reader:
        assert _consume_all(reader, "h") == 2
    assert (store.path / OFFSETS_FILE).read_bytes() == before
    assert sorted(os.listdir(store.path / CONSUMERS_DIR)) == ["g.json", "h.json"]
    assert store.consumer_groups() == {
        "w": {"t": {0: 1}},
        "g": {"t": {0: 2, 1: 0, 2: 0, 3: 0}},
        "h": {"t": {0: 2, 1: 0, 2: 0, 3: 0}},
    }


def test_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's first example (the consumer loop) as a user would run it."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=BOUNDED
    )
    assert result.returncode == 0, result.stderr
    got, consumed = result.stdout.splitlines()
    queue_id, offset, text = consumed.split(" ", 2)
    assert got == text == "b'{\"id\": 1}'" and offset == "0"
    with MessageStore.open(tmp_path / "my-store", read_only=True) as store:
        expected = {q: int(q == int(queue_id)) for q in store.queue_ids("orders")}
        assert store.consumer_groups() == {"billing": {"orders": expected}}
