"""Dead letters that would go round for ever, and delayed retries of a deleted topic
(review19 R19-9, R19-6): a group may not consume its own dead letters; a message read
from a dead-letter topic is dead-lettered once more at most (``equeue.dlq.from``), so
groups consuming each other's dead letters stop after one copy; a delayed retry of a
message stored before its topic's deletion is dropped when due."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_retry import DELAYS, Clock, everything

from equeue import MessageStore
from equeue.errors import InvalidMessageError
from equeue.protocol.retries import DLQ_FROM
from equeue.server import retry
from equeue.server.groups import GroupCoordinator

DLQ_G, DLQ_H = retry.dead_letter_topic("g"), retry.dead_letter_topic("h")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "s") as s:
        s.create_topic("orders", 1)
        yield s


def _coordinator(store: MessageStore, clock: Clock, max_retries: int) -> GroupCoordinator:
    return GroupCoordinator(
        store, clock=clock, wall_clock=clock, retry_delays=DELAYS, max_retries=max_retries
    )


def test_a_group_may_not_consume_its_own_dead_letters(store: MessageStore) -> None:
    coord = _coordinator(store, Clock(), 0)
    store.create_topic(DLQ_G, 1)
    topics = sorted(store.topics())
    with pytest.raises(InvalidMessageError, match="cannot consume its own dead letters"):
        coord.join("g", "a", ["orders", DLQ_G], 600_000)
    assert coord.stats() == {} and sorted(store.topics()) == topics
    coord.join("h", "a", [DLQ_G], 600_000)  # another group may


def test_groups_consuming_each_others_dead_letters_stop_after_one_copy(
    store: MessageStore,
) -> None:
    coord = _coordinator(store, Clock(), 0)  # every nack dead-letters at once
    poison = store.send("orders", b"poison")
    store.create_topic(DLQ_H, 1)
    coord.join("g", "a", ["orders", DLQ_H], 600_000)
    coord.nack("g", "a", poison.message_id, None)
    (first,) = everything(store, DLQ_G)
    assert DLQ_FROM not in first.properties  # read from orders, not a dead-letter topic
    coord.join("h", "b", [DLQ_G], 600_000)
    coord.nack("h", "b", first.message_id, None)
    (second,) = everything(store, DLQ_H)
    assert second.body == b"poison" and second.properties[DLQ_FROM] == DLQ_G
    coord.nack("g", "a", second.message_id, None)  # round again: not copied
    assert [m.message_id for m in everything(store, DLQ_G)] == [first.message_id]
    assert [m.message_id for m in everything(store, DLQ_H)] == [second.message_id]
    counts = coord.retries.stats()
    assert (counts["dead_lettered"], counts["dead_letter_cycles"]) == (2, 1)


def test_a_delayed_retry_of_a_deleted_topics_message_is_dropped_when_due(
    store: MessageStore,
) -> None:
    clock = Clock()
    coord = _coordinator(store, clock, 3)
    coord.join("g", "a", ["orders"], 600_000)
    old = store.send("orders", b"old-0")
    kept = store.send("orders", b"old-1")
    coord.nack("g", "a", old.message_id, None)
    coord.nack("g", "a", kept.message_id, None)
    clock.now += DELAYS[0]
    coord.tick()  # the control: both moved while the topic stands
    assert [m.body for m in everything(store, retry.retry_topic("g"))] == [b"old-0", b"old-1"]
    again = store.send("orders", b"old-2")
    coord.nack("g", "a", again.message_id, None)
    store.delete_topic("orders")
    store.create_topic("orders", 1)
    new = store.send("orders", b"new-0")
    assert (new.queue_id, new.queue_offset) == (0, 0)  # old-0's coordinates
    clock.now += DELAYS[0]
    coord.tick()
    assert [m.body for m in everything(store, retry.retry_topic("g"))] == [b"old-0", b"old-1"]
    counts = coord.retries.stats()
    assert (counts["moved"], counts["dropped_deleted_topic"], counts["pending"]) == (2, 1, 0)


def test_a_dlq_from_carried_in_from_an_ordinary_topic_does_not_stop_the_first_hop(
    store: MessageStore,
) -> None:
    """review20 R20-5: a dead letter sent back to its topic (a replay) keeps its
    properties; its next dead letter starts the count afresh."""
    coord = _coordinator(store, Clock(), 0)
    replayed = store.send("orders", b"replayed", properties={DLQ_FROM: "equeue.dlq.x"})
    coord.join("g", "a", ["orders"], 600_000)
    coord.nack("g", "a", replayed.message_id, None)
    (first,) = everything(store, DLQ_G)
    assert DLQ_FROM not in first.properties
    store.create_topic("other", 1)
    coord.join("h", "b", [DLQ_G], 600_000)
    coord.nack("h", "b", first.message_id, None)
    (second,) = everything(store, DLQ_H)
    assert second.properties[DLQ_FROM] == DLQ_G
    assert coord.retries.stats()["dead_letter_cycles"] == 0


def test_retries_of_a_topic_made_again_before_they_were_sent_are_kept_and_counted_once(
    store: MessageStore,
) -> None:
    """The control of R19-6's drop (review20 R20-3): a message sent after its topic was
    made again keeps its retry; and R20-8: a dropped copy after a kept one in a due run
    is counted once (the cursor passed it)."""
    clock = Clock()
    coord = _coordinator(store, clock, 3)
    store.create_topic("other", 1)
    coord.join("g", "a", ["orders", "other"], 600_000)
    kept = store.send("orders", b"kept")
    gone = store.send("other", b"gone")
    coord.nack("g", "a", kept.message_id, None)
    coord.nack("g", "a", gone.message_id, None)
    store.delete_topic("other")
    store.create_topic("other", 1)
    clock.now += DELAYS[0]
    coord.tick()  # the due run: kept, then gone (its last)
    again = store.send("other", b"sent after the topic was made again")
    coord.nack("g", "a", again.message_id, None)
    for _ in range(3):
        clock.now += DELAYS[0]
        coord.tick()
    moved = [m.body for m in everything(store, retry.retry_topic("g"))]
    assert moved == [b"kept", b"sent after the topic was made again"]
    counts = coord.retries.stats()
    assert (counts["moved"], counts["dropped_deleted_topic"], counts["pending"]) == (2, 1, 0)
