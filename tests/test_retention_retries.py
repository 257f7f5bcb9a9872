"""Retention against the broker's delayed retries and idle groups (review 37a A4, A6).

A4: with ``retention_respects_consumers`` a delay queue counts as read by the retry
mover from its cursor, or from the queue's first offset before the mover committed
one; a retry topic as read by its group from its commit, or from its first offset.
Without the flag retention removes what it removes, and the mover logs and counts the
copies it lost (``Retries.lost_to_retention``), once, across a restart too.
A6: who holds retention back is logged once (not at every run) and kept for stats; a
group's hold is released by committing its offsets to the queues' ends.

On a real store of 4 KiB chunks; the coordinator's clock is injected, retention's
``now`` given (the messages carry real timestamps)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.errors import ChunkRemovedError
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import retry
from equeue.server.groups import GroupCoordinator
from equeue.server.stats import retry_and_retention
from equeue.server.status import render_stats
from equeue.store.retentionhold import retention_hold

DELAYS = (1.0, 5.0, 30.0)
RETRY = retry.retry_topic("g")
FILLER = b"f" * 900  # 4 a chunk: 40 sends fill ~10 chunks


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def open_store(path: Path, **retention: object) -> MessageStore:
    config = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, **retention)  # type: ignore[arg-type]
    return MessageStore.open(path, config)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def later() -> float:
    """A retention run's ``now`` at which every chunk is past a 1 s retention."""
    return time.time() + 60


def nacked_then_consumed(store: MessageStore, clock: Clock) -> GroupCoordinator:
    """Group g nacks its first message with a 30 s delay, then consumes and commits 40
    more (10 log chunks): everything of topic t is consumed; only the delay copy waits."""
    store.create_topic("t", 1)
    coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=DELAYS)
    coord.join("g", "a", ["t"], 600_000)
    sent = store.send("t", b"nackme")
    coord.nack("g", "a", sent.message_id, 30_000)
    assert store.queue_range(retry.DELAY_TOPIC, 2) == (0, 1)
    for _ in range(40):
        store.send("t", FILLER)
    store.commit_offset("g", "t", 0, store.queue_range("t", 0)[1])
    return coord


def test_respecting_consumers_keeps_a_delayed_retry_until_the_mover_moved_it(
    tmp_path: Path, clock: Clock
) -> None:
    retention = {"retention": dt.timedelta(seconds=1), "retention_respects_consumers": True}
    with open_store(tmp_path / "s", **retention) as store:
        coord = nacked_then_consumed(store, clock)
        assert store.apply_retention(now=later()) == 0  # the copy is in the first chunk
        assert store.queue_range(retry.DELAY_TOPIC, 2) == (0, 1)
        hold = retention_hold(store)
        assert hold is not None and hold.expired
        assert (hold.reader.group, hold.reader.topic, hold.reader.offset) == (
            retry.MOVER_GROUP, retry.DELAY_TOPIC, 0,
        )  # fmt: skip
        assert not hold.reader.committed  # the mover has no cursor there yet
        clock.now += 30.0
        coord.tick()
        (copy,) = store.pull(RETRY, 0, 0, 10).messages
        assert (copy.body, copy.properties[retry.ATTEMPT]) == (b"nackme", "1")
        assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, 2) == 1
        # moved: now the copy in g's retry topic holds it, until g commits there
        for _ in range(40):
            store.send("t", FILLER)
        store.commit_offset("g", "t", 0, store.queue_range("t", 0)[1])
        store.apply_retention(now=later())
        hold = retention_hold(store)
        assert hold is not None
        assert (hold.reader.group, hold.reader.topic) == ("g", RETRY)
        assert not hold.reader.committed
        assert store.pull(RETRY, 0, 0, 10).messages == [copy]
        store.commit_offset("g", RETRY, 0, 1)
        assert store.apply_retention(now=later()) > 0
        assert retention_hold(store) is None
        assert store.queue_range("t", 0)[0] > 0


def test_without_respecting_consumers_a_lost_retry_is_logged_and_counted_once(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="equeue.retry")
    with open_store(tmp_path / "s", retention=dt.timedelta(seconds=1)) as store:
        coord = nacked_then_consumed(store, clock)
        assert store.apply_retention(now=later()) > 0
        assert store.queue_range(retry.DELAY_TOPIC, 2) == (1, 1)  # the copy went
        clock.now += 30.0
        coord.tick()
        coord.tick()
        assert RETRY not in store.topics() or store.queue_range(RETRY, 0) == (0, 0)
        assert coord.retries.lost_to_retention == 1
        assert retry_and_retention(store, coord.retries)["retry"] == {
            "moved": 0, "dead_lettered": 0, "pending": 0, "lost_to_retention": 1,
            "nacked_removed": 0, "nacked_again": 0, "dropped_deleted_group": 0,
            "dropped_deleted_topic": 0, "dead_letter_cycles": 0,
        }  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "before they were due" in r.message]
        assert len(said) == 1, said
        assert "1 delayed retries of equeue.delay/2 (offsets 0 to 0)" in said[0]
        assert "--retention-respects-consumers" in said[0]
        # the cursor passed them on disk: a restarted mover does not count them again
        assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, 2) == 1
    with open_store(tmp_path / "s", retention=dt.timedelta(seconds=1)) as store:
        again = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=DELAYS)
        again.tick()
        assert again.retries.lost_to_retention == 0
    assert len([r for r in caplog.records if "before they were due" in r.message]) == 1


def test_a_mover_whose_cursors_were_set_aside_counts_nothing_lost(
    tmp_path: Path, clock: Clock
) -> None:
    """Its cursors gone, a delay queue's first retained offset above 0 may be copies it
    had moved: not counted as lost (the open's warning says it moves again)."""
    with open_store(tmp_path / "s", retention=dt.timedelta(seconds=1)) as store:
        coord = nacked_then_consumed(store, clock)
        clock.now += 30.0
        coord.tick()  # moved, its cursor committed
        assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, 2) == 1
        for _ in range(40):
            store.send("t", FILLER)
        assert store.apply_retention(now=later()) > 0
        assert store.queue_range(retry.DELAY_TOPIC, 2) == (1, 1)
    (tmp_path / "s" / "consumers" / f"{retry.MOVER_GROUP}.json").write_bytes(b"junk")
    with open_store(tmp_path / "s", retention=dt.timedelta(seconds=1)) as store:
        again = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=DELAYS)
        again.tick()
        assert again.retries.lost_to_retention == 0


@pytest.fixture
def pinned(tmp_path: Path) -> Iterator[MessageStore]:
    """Group 'old' committed offset 1 of t/0 once; 40 chunks sent since (limit: 4)."""
    config = {"max_store_bytes": 20480, "retention_respects_consumers": True}
    with open_store(tmp_path / "s", **config) as store:
        store.create_topic("t", 1)
        store.send("t", b"first")
        store.commit_offset("old", "t", 0, 1)
        for _ in range(160):
            store.send("t", FILLER)
        yield store


def test_who_holds_retention_is_logged_once_and_shown_in_stats(
    pinned: MessageStore, caplog: pytest.LogCaptureFixture, clock: Clock
) -> None:
    caplog.set_level(logging.INFO, logger="equeue.retention")
    for _ in range(3):  # three checkpoints' runs: one line
        assert pinned.apply_retention() == 0
    said = [r.getMessage() for r in caplog.records if "retention held" in r.message]
    assert len(said) == 1, said
    assert "retention held by group 'old' at t/0 offset 1:" in said[0]
    assert "over max_store_bytes (--max-store-bytes) 20480" in said[0]
    coord = GroupCoordinator(pinned, clock=clock, wall_clock=clock)
    stats = retry_and_retention(pinned, coord.retries)
    held = stats["retention_held"]
    assert (held["group"], held["queue"], held["offset"], held["committed"]) == (
        "old", "t/0", 1, True,
    )  # fmt: skip
    assert held["log_bytes"] > held["max_store_bytes"] == 20480
    assert "retention held by group 'old' at t/0 offset 1 for " in render_stats(
        {**stats, "listen": []}
    )


def test_committing_an_idle_groups_offsets_to_the_end_releases_its_hold(
    pinned: MessageStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The documented way to release a group (docs/broker.md, "Retention")."""
    caplog.set_level(logging.INFO, logger="equeue.retention")
    assert pinned.apply_retention() == 0
    size = sum(chunk.file_size for chunk in pinned._messages)
    pinned.commit_offset("old", "t", 0, pinned.queue_range("t", 0)[1])
    assert pinned.apply_retention() > 0
    assert sum(chunk.file_size for chunk in pinned._messages) < size
    assert retention_hold(pinned) is None
    assert any("no longer held (it was by group 'old')" in r.message for r in caplog.records)


def test_a_nack_of_a_message_retention_removed_is_answered_and_counted(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # reviewf F8: the nack raised (ChunkRemovedError, CompactedAwayError through the broker),
    # the client reset its membership and the broker logged its join again as a fencing;
    # nothing was retried or counted
    with open_store(tmp_path / "s", retention=dt.timedelta(seconds=1)) as store:
        store.create_topic("t", 1)
        coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=DELAYS)
        answer = coord.join("g", "a", ["t"], 600_000)
        handed = store.send("t", b"handed out, then removed")
        for _ in range(40):
            store.send("t", FILLER)
        assert store.apply_retention(now=later()) > 0
        with pytest.raises(ChunkRemovedError):
            store.get(handed.message_id)
        join_id = answer["join_id"]
        coord.nack("g", "a", handed.message_id, 0, join_id=join_id)  # no error
        assert coord.retries.stats()["nacked_removed"] == 1
        assert coord.retries.stats()["moved"] == 0 and coord.retries.pending() == 0
        assert "not retried" in caplog.text
        coord.heartbeat("g", "a", join_id=join_id)  # still the member it was
        # the control: a nack of a message still there is retried as before
        kept = store.send("t", b"kept")
        coord.nack("g", "a", kept.message_id, 0, join_id=join_id)
        assert coord.retries.stats()["nacked_removed"] == 1
