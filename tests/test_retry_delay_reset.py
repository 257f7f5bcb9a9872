"""The retry mover after its delay topic (``equeue.delay``) is deleted and made again
under a running broker (a caller's handle embedding it can): the queues start again at
offset 0, so the mover's remembered cursor and head due time belong to copies that are
gone. Driven with injected clocks: a wall-clock step back is one of the cases."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from equeue import MessageStore
from equeue.server.groups import GroupCoordinator
from equeue.server.retry import DELAY_TOPIC, RETRY_PREFIX

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "s") as opened:
        opened.create_topic("t", 1)
        yield opened


def _coordinator(store: MessageStore, clock: Clock) -> GroupCoordinator:
    coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=(1.0, 60.0))
    coord.join("g", "a", ["t"], 600_000)
    return coord


def _nack(store: MessageStore, coord: GroupCoordinator, *bodies: bytes) -> None:
    for body in bodies:
        coord.nack("g", "a", store.send("t", body).message_id, 1000)  # level 0: 1 s


def _retried_after(store: MessageStore, coord: GroupCoordinator, clock: Clock) -> list[bytes]:
    """What the retry topic holds after a tick 1.5 s later: every copy due by then."""
    clock.now += 1.5
    coord.tick()
    topic = RETRY_PREFIX + "g"
    if topic not in store.topics():
        return []
    return [m.body for m in store.pull(topic, 0, 0, 1000).messages]


def test_a_copy_in_the_delay_queue_made_again_moves_after_a_clock_step_back(
    store: MessageStore,
) -> None:
    clock = Clock()
    coord = _coordinator(store, clock)
    _nack(store, coord, b"one", b"two")
    assert _retried_after(store, coord, clock) == [b"one", b"two"]  # the mover's cursor: 2
    _nack(store, coord, b"waits")  # due 1 s on, remembered as the queue's head
    coord.tick()
    store.delete_topic(DELAY_TOPIC)  # "waits" is gone with it
    clock.now = T0 - 1000.0  # the wall clock steps back (NTP, an operator)
    _nack(store, coord, b"after")  # the delay topic made again: offset 0, due T0 - 999 s
    assert _retried_after(store, coord, clock) == [b"one", b"two", b"after"]


def test_copies_below_the_old_cursor_of_a_delay_queue_made_again_are_moved(
    store: MessageStore,
) -> None:
    clock = Clock()
    coord = _coordinator(store, clock)
    _nack(store, coord, b"one")
    assert _retried_after(store, coord, clock) == [b"one"]  # the mover's cursor: 1
    store.delete_topic(DELAY_TOPIC)
    _nack(store, coord, b"first", b"second")  # offsets 0 and 1 of the queue made again
    assert _retried_after(store, coord, clock) == [b"one", b"first", b"second"]


def test_a_cursor_write_in_flight_at_the_deletion_does_not_skip_the_new_copies(
    tmp_path: Path,
) -> None:
    """Review 37-2 F1: the mover's cursor write (on the broker's committer thread) still
    running when the delay topic is deleted landed after the deletion dropped its entries,
    for the topic made again; a file offset is never lowered, so the right cursors were
    never written, and after a restart the copies below the stale cursor were never moved
    (3 of 5 here, nothing logged or counted)."""
    held: list[tuple[Callable[[], None], Future[None]]] = []

    def background(work: Callable[[], None]) -> Future[None]:
        done: Future[None] = Future()
        held.append((work, done))
        return done

    def run_held() -> None:
        while held:
            work, done = held.pop(0)
            work()
            done.set_result(None)

    clock = Clock()
    path = tmp_path / "race"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        coord = _coordinator(store, clock)
        coord.retries.background = background
        _nack(store, coord, b"old1", b"old2", b"old3")
        assert _retried_after(store, coord, clock) == [b"old1", b"old2", b"old3"]
        assert len(held) == 1  # the cursor write, not run yet
        store.delete_topic(DELAY_TOPIC)
        run_held()  # it ends after the deletion
        _nack(store, coord, b"new0")  # the delay topic made again: offset 0
        assert _retried_after(store, coord, clock)[3:] == [b"new0"]
        run_held()
    with MessageStore.open(path) as store:  # the broker restarts
        coord = _coordinator(store, clock)
        _nack(store, coord, b"new1", b"new2", b"new3")  # offsets 1..3
        assert _retried_after(store, coord, clock)[4:] == [b"new1", b"new2", b"new3"]
