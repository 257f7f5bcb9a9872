"""Retention with ``retention_respects_consumers`` beside a damaged consumer group file
(reviewf F9): the group's offsets as this handle last read them stand for it, and a
group file of which nothing is known holds retention whole, never acting as if the group
had committed nothing. On a real store of 4 KiB chunks; retention's ``now`` given."""

from __future__ import annotations

import datetime as dt
import logging
import time
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server.status import render_stats
from equeue.store.offsets import file_name
from equeue.store.retentionhold import retention_hold

FILLER = b"f" * 900  # 4 a chunk


def open_store(path: Path) -> MessageStore:
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE,
        retention=dt.timedelta(seconds=1),
        retention_respects_consumers=True,
    )
    return MessageStore.open(path, config)


def later() -> float:
    return time.time() + 60


def filled(store: MessageStore) -> None:
    store.create_topic("t", 1)
    for _ in range(60):
        store.send("t", FILLER)
    with store.consumer("g", "t", timeout=0) as consumer:
        assert len(consumer.poll(20)) == 20
    assert store.committed_offset("g", "t", 0) == 20


@pytest.mark.parametrize("damage", [None, b"junk", b""])
def test_a_group_file_damaged_after_it_was_read_keeps_its_offsets(
    tmp_path: Path, damage: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    with open_store(tmp_path / "s") as store:
        filled(store)
        if damage is not None:
            (tmp_path / "s" / "consumers" / file_name("g")).write_bytes(damage)
        store.apply_retention(now=later())
        first, _ = store.queue_range("t", 0)
        # the chunks before g's offset 20 may go, none after it (was: t/0 began at 56)
        assert 0 < first <= 20
        assert store.committed_offset("g", "t", 0) == 20
        if damage is not None:
            assert "its offsets as last read are used" in caplog.text
        with store.consumer("g", "t", timeout=0) as consumer:
            assert [m.queue_offset for m in consumer.poll(5)] == [20, 21, 22, 23, 24]


def test_a_group_file_never_read_whole_holds_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with open_store(tmp_path / "s") as store:
        filled(store)
        (tmp_path / "s" / "consumers" / file_name("h")).write_bytes(b"junk from outside")
        assert store.apply_retention(now=later()) == 0
        assert store.queue_range("t", 0)[0] == 0
        hold = retention_hold(store)
        assert hold is not None and hold.reader.damaged is not None
        assert "h.json" in hold.as_stats()["damaged"]
        assert "cannot be read" in caplog.text and "move it out of consumers/" in caplog.text
        shown = render_stats({"retention_held": hold.as_stats()})
        assert "retention held by an unreadable consumer group file (" in shown, shown
        # moved away (what the operator is told), retention goes on up to g's offset
        (tmp_path / "s" / "consumers" / file_name("h")).rename(tmp_path / "h.json")
        assert store.apply_retention(now=later()) > 0
        assert 0 < store.queue_range("t", 0)[0] <= 20
        held = retention_hold(store)
        assert held is not None and held.reader.group == "g"


def test_a_deleted_topic_leaves_the_offsets_standing_for_a_damaged_file(tmp_path: Path) -> None:
    # review3 R3: the last good offsets kept the deleted topic's 20, and the topic made
    # again under the name was read from there: its first 20 messages never reached g
    with open_store(tmp_path / "s") as store:
        filled(store)
        (tmp_path / "s" / "consumers" / file_name("g")).write_bytes(b"junk")
        store.delete_topic("t")
        store.create_topic("t", 1)
        for i in range(5):
            store.send("t", b"new%d" % i)
        assert store.committed_offset("g", "t", 0) is None
        with store.consumer("g", "t", timeout=0) as consumer:
            assert [m.body for m in consumer] == [b"new%d" % i for i in range(5)]


def test_a_group_file_set_aside_at_open_holds_retention_until_the_group_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # review3 R5: damaged while no writer ran, the file was moved to consumers/recovered/
    # at the next open, the group forgotten, and the first retention turn removed its
    # backlog (t/0 then began at 56; g had committed 20)
    caplog.set_level(logging.WARNING)
    with open_store(tmp_path / "s") as store:
        filled(store)
    (tmp_path / "s" / "consumers" / file_name("g")).write_bytes(b"junk")
    with open_store(tmp_path / "s") as store:
        (moved,) = (tmp_path / "s" / "consumers" / "recovered").iterdir()
        assert store.apply_retention(now=later()) == 0
        hold = retention_hold(store)
        assert hold is not None and moved.name in hold.as_stats()["damaged"]
        assert "delete that copy to release retention" in caplog.text
    with open_store(tmp_path / "s") as store:  # across a restart too
        assert store.apply_retention(now=later()) == 0
        # the group commits again (here from its start): the hold ends at its offsets
        with store.consumer("g", "t", timeout=0) as consumer:
            assert len(consumer.poll(10)) == 10
        assert store.apply_retention(now=later()) > 0
        assert 0 < store.queue_range("t", 0)[0] <= 10


def test_a_copy_name_with_a_non_ascii_digit_is_not_a_copy(tmp_path: Path) -> None:
    # review10 F4: "\u00b2".isdigit() is true and int() refuses it, so every retention turn
    # raised a builtin ValueError; no equeue writes such a name (its stamps are ASCII digits)
    with open_store(tmp_path / "s") as store:
        filled(store)
        foreign = tmp_path / "s" / "consumers" / "recovered" / f"{file_name('g')}.\u00b2.damaged"
        foreign.parent.mkdir()
        foreign.write_bytes(b"a file no equeue wrote")
        assert store.apply_retention(now=later()) > 0
        assert 0 < store.queue_range("t", 0)[0] <= 20
        hold = retention_hold(store)  # held by g's own offset 20 only
        assert hold is not None and hold.reader.damaged is None and hold.reader.offset == 20
        assert foreign.read_bytes() == b"a file no equeue wrote"
