"""Retries and dead letters (equeue/server/retry.py) through the coordinator, with an
injected clock, on a real store that is also closed and reopened between ticks."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue import Message, MessageStore, PullResult
from equeue.errors import GroupError, MessageNotFoundError, StoreWriteError
from equeue.protocol.retries import MAX_RETRIES_LIMIT
from equeue.server import retry
from equeue.server.groups import GroupCoordinator

RETRY = retry.retry_topic("g")
DLQ = retry.dead_letter_topic("g")
DELAYS = (1.0, 5.0, 30.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "s") as s:
        s.create_topic("orders", 2)
        yield s


def coordinator(store: MessageStore, clock: Clock, max_retries: int = 3) -> GroupCoordinator:
    coord = GroupCoordinator(
        store, clock=clock, wall_clock=clock, retry_delays=DELAYS, max_retries=max_retries
    )
    coord.join("g", "a", ["orders"], 600_000)
    return coord


def everything(store: MessageStore, topic: str) -> list[Message]:
    found: list[Message] = []
    for queue_id in store.queue_ids(topic):
        found += store.pull(topic, queue_id, 0, 1000).messages
    return found


def test_nack_waits_its_level_then_comes_back_in_the_retry_topic(
    store: MessageStore, clock: Clock
) -> None:
    coord = coordinator(store, clock)
    sent = store.send("orders", b"pay", tag="t", key="k", properties={"user": "1"}, code=7)
    coord.nack("g", "a", sent.message_id, None)
    delayed = everything(store, retry.DELAY_TOPIC)
    assert [m.queue_id for m in delayed] == [0]  # attempt 1: the first level
    assert delayed[0].properties[retry.DUE_MS] == str(int((clock.now + 1.0) * 1000))
    clock.now += 0.999
    coord.tick()
    assert everything(store, RETRY) == []
    clock.now += 0.002
    coord.tick()
    (copy,) = everything(store, RETRY)
    assert (copy.body, copy.tag, copy.key, copy.code) == (b"pay", "t", "k", 7)
    assert copy.properties == {
        "user": "1",
        retry.GROUP: "g",
        retry.ATTEMPT: "1",
        retry.ORIGIN_TOPIC: "orders",
        retry.ORIGIN_QUEUE: str(sent.queue_id),
        retry.ORIGIN_OFFSET: str(sent.queue_offset),
        retry.ORIGIN_ID: sent.message_id,
    }
    restored = retry.restore(copy)
    assert (restored.topic, restored.queue_id, restored.queue_offset) == (
        "orders", sent.queue_id, sent.queue_offset,
    )  # fmt: skip
    assert restored.message_id == copy.message_id
    coord.tick()
    assert len(everything(store, RETRY)) == 1  # moved once


def test_attempts_climb_the_levels_then_the_dead_letter_topic(
    store: MessageStore, clock: Clock
) -> None:
    coord = coordinator(store, clock, max_retries=3)
    message_id = store.send("orders", b"x", queue_id=1).message_id
    levels = []
    for attempt in range(1, 4):
        coord.nack("g", "a", message_id, None)
        delayed = everything(store, retry.DELAY_TOPIC)[-1]
        levels.append(delayed.queue_id)
        clock.now += DELAYS[delayed.queue_id]
        coord.tick()
        copy = everything(store, RETRY)[-1]
        assert copy.properties[retry.ATTEMPT] == str(attempt)
        message_id = copy.message_id
    assert levels == [0, 1, 2]
    assert DLQ not in store.topics()
    coord.nack("g", "a", message_id, None)  # the 4th nack: past max_retries=3
    (dead,) = everything(store, DLQ)
    assert dead.properties[retry.ATTEMPT] == "4"
    assert dead.properties[retry.ORIGIN_TOPIC] == "orders"
    assert dead.properties[retry.ORIGIN_QUEUE] == "1"
    assert retry.DUE_MS not in dead.properties
    assert len(everything(store, retry.DELAY_TOPIC)) == 3  # nothing more was delayed
    assert DLQ in store.topics() and store.queue_ids(DLQ) == [0]


def test_max_retries_zero_dead_letters_at_once(store: MessageStore, clock: Clock) -> None:
    coord = coordinator(store, clock, max_retries=0)
    coord.nack("g", "a", store.send("orders", b"x").message_id, 50)
    assert len(everything(store, DLQ)) == 1
    assert retry.DELAY_TOPIC not in store.topics()


def test_given_delays_round_up_to_a_level(store: MessageStore, clock: Clock) -> None:
    coord = coordinator(store, clock)
    for delay_ms in (1, 1000, 1001, 30_000, 99_000_000):
        coord.nack("g", "a", store.send("orders", b"x").message_id, delay_ms)
    assert [m.queue_id for m in everything(store, retry.DELAY_TOPIC)] == [0, 0, 1, 2, 2]
    coord.nack("g", "a", store.send("orders", b"now").message_id, 0)
    assert [m.body for m in everything(store, RETRY)] == [b"now"]  # no delay queue


def test_nack_by_a_non_holder_writes_nothing(store: MessageStore, clock: Clock) -> None:
    coord = coordinator(store, clock)
    store.create_topic("other", 1)
    sent = store.send("orders", b"x", queue_id=1)
    coord.join("g", "b", ["orders"], 600_000)  # orders/1 is b's target, a holds it still
    with pytest.raises(GroupError, match="does not hold orders/1"):
        coord.nack("g", "b", sent.message_id, None)
    with pytest.raises(GroupError, match="has no consumer"):
        coord.nack("g", "z", sent.message_id, None)
    with pytest.raises(MessageNotFoundError):
        coord.nack("g", "a", "f" * 24, None)
    assert retry.DELAY_TOPIC not in store.topics()
    assert everything(store, RETRY) == []


def test_hostile_properties_in_the_retry_topic(store: MessageStore, clock: Clock) -> None:
    """A message put into the retry topic by hand, with retry properties that do not
    parse, is its own origin; a delay copy whose due time does not parse is due now."""
    coord = coordinator(store, clock)
    bad = {retry.ATTEMPT: "many", retry.ORIGIN_QUEUE: "x", retry.ORIGIN_TOPIC: "orders"}
    sent = store.send(RETRY, b"odd", properties=bad)
    assert retry.restore(store.get(sent.message_id)).topic == RETRY
    coord.nack("g", "a", sent.message_id, None)
    (delayed,) = everything(store, retry.DELAY_TOPIC)
    assert delayed.properties[retry.ATTEMPT] == "1"
    assert delayed.properties[retry.ORIGIN_TOPIC] == RETRY
    store.send(retry.DELAY_TOPIC, b"due?", properties={retry.DUE_MS: "soon"}, queue_id=1)
    store.send(retry.DELAY_TOPIC, b"no group", properties={retry.DUE_MS: "0"}, queue_id=2)
    coord.tick()  # "soon" and no group: moved now / dropped; the real copy waits
    assert [m.body for m in everything(store, RETRY)] == [b"odd"]
    assert coord.retries.pending() == 1


@pytest.mark.parametrize(
    "due", ["inf", "nan", "1e400", "-5", "99999999999999999999", "1" * 5000, "\u0663", " 5", "5.0"]
)
def test_a_due_time_the_mover_never_writes_is_reported_and_due_now(
    store: MessageStore, clock: Clock, caplog: pytest.LogCaptureFixture, due: str
) -> None:
    """equeue.due_ms is read from the log: one that is not the mover's ASCII digits of
    ms (float() read "inf", "1e400" and a 20-digit value as a time never reached, the
    level's FIFO blocked behind it; "nan" and "-5" as due, silently) is logged with where
    the copy is, and the copy is due now: the good copy behind it is moved too."""
    coord = coordinator(store, clock)
    coord.retries.ensure(retry.DELAY_TOPIC, len(DELAYS))
    bad = store.send(
        retry.DELAY_TOPIC, b"bad", properties={retry.GROUP: "g", retry.DUE_MS: due}, queue_id=0
    )
    sent = store.send("orders", b"good", queue_id=0)
    coord.nack("g", "a", sent.message_id, 1000)  # level 0 too, behind the bad copy
    clock.now += 1.0
    with caplog.at_level("WARNING", logger="equeue.retry"):
        coord.tick()
    assert [m.body for m in everything(store, RETRY)] == [b"bad", b"good"]
    (warning,) = [r.getMessage() for r in caplog.records if "due time" in r.getMessage()]
    assert f"{retry.DELAY_TOPIC} queue 0 offset 0 (message {bad.message_id}" in warning
    assert f"log position {bad.position} in {store.path / 'messages'}" in warning
    assert repr(due[:40]) in warning


def test_a_due_time_at_most_the_longest_delay_ahead_waits(
    store: MessageStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The bound of a due time read: now + MAX_DELAY_S (the longest delay a level may
    have) waits; a millisecond more is not one the mover wrote."""
    coord = coordinator(store, clock)
    coord.retries.ensure(retry.DELAY_TOPIC, len(DELAYS))
    latest = int(clock.now * 1000) + retry.MAX_DELAY_S * 1000
    for queue_id, due in ((0, latest), (1, latest + 1)):
        props = {retry.GROUP: "g", retry.DUE_MS: str(due)}
        store.send(retry.DELAY_TOPIC, b"%d" % queue_id, properties=props, queue_id=queue_id)
    with caplog.at_level("WARNING", logger="equeue.retry"):
        coord.tick()
    assert [m.body for m in everything(store, RETRY)] == [b"1"]
    assert [r for r in caplog.records if "due time" in r.getMessage()] != []


def test_mover_restart_neither_loses_nor_moves_again(tmp_path: Path, clock: Clock) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("orders", 2)
        coord = coordinator(store, clock)
        for i in range(6):
            sent = store.send("orders", b"%d" % i, queue_id=0)
            coord.nack("g", "a", sent.message_id, 1000 if i < 3 else 5000)
        clock.now += 1.0
        coord.tick()  # the 1 s ones
        assert [m.body for m in everything(store, RETRY)] == [b"0", b"1", b"2"]
    # a new broker on the reopened store: the cursor was persisted
    with MessageStore.open(path) as store:
        coord = coordinator(store, clock)
        coord.tick()
        assert [m.body for m in everything(store, RETRY)] == [b"0", b"1", b"2"]
        assert coord.retries.pending() == 3
        clock.now += 4.0
        coord.tick()
        assert [m.body for m in everything(store, RETRY)] == [b"0", b"1", b"2", b"3", b"4", b"5"]
        assert coord.retries.pending() == 0


def test_crash_between_move_and_cursor_moves_again(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mover appends, then commits its cursor: while the cursor write fails, nothing
    is moved again (each tick writes it again); a crash then moves the copies a second
    time after the restart (at least once), never loses them."""
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("orders", 2)
        coord = coordinator(store, clock)
        coord.nack("g", "a", store.send("orders", b"m").message_id, 1000)
        clock.now += 1.0
        attempts: list[object] = []

        def fail(*args: object) -> None:
            attempts.append(args)
            raise StoreWriteError(5, "simulated crash before the cursor is committed")

        monkeypatch.setattr(coord.retries, "commit_cursors", fail)
        for _ in range(3):
            coord.tick()  # logged, not raised (it was: the broker's tick logged a traceback)
        assert [m.body for m in everything(store, RETRY)] == [b"m"]
        assert len(attempts) == 3
    monkeypatch.undo()
    with MessageStore.open(path) as store:
        coord = coordinator(store, clock)
        coord.tick()
        assert [m.body for m in everything(store, RETRY)] == [b"m", b"m"]
        coord.tick()
        assert len(everything(store, RETRY)) == 2


def test_mover_fdatasyncs_the_log_once_a_tick_before_its_cursors(
    store: MessageStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No checkpoint (store.flush fdatasyncs every queue file) on the broker's loop: one
    fdatasync of the message log covers every delay queue's copies, then the cursors."""
    coord = coordinator(store, clock)
    for delay_ms in (1000, 5000, 30_000):  # one copy in each of the three delay queues
        coord.nack("g", "a", store.send("orders", b"x").message_id, delay_ms)
    calls: list[str] = []

    def record(name: str, real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(store, "flush", record("flush", store.flush))
    monkeypatch.setattr(store, "flush_log", record("flush_log", store.flush_log))
    monkeypatch.setattr(store, "send_batch", record("send_batch", store.send_batch))
    monkeypatch.setattr(
        coord.retries, "commit_cursors", record("commit", coord.retries.commit_cursors)
    )
    clock.now += 31.0
    coord.tick()
    assert calls == ["send_batch", "send_batch", "send_batch", "flush_log", "commit"]
    assert [m.body for m in everything(store, RETRY)] == [b"x"] * 3
    assert [store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, q) for q in range(3)] == [
        1,
        1,
        1,
    ]


def test_mover_reads_a_waiting_queue_once_until_its_head_is_due(
    store: MessageStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord = coordinator(store, clock)
    coord.nack("g", "a", store.send("orders", b"x").message_id, 1000)
    pulls: list[str] = []
    real_pull = store.pull

    def counting_pull(topic: str, *args: Any, **kwargs: Any) -> PullResult:
        pulls.append(topic)
        return real_pull(topic, *args, **kwargs)

    monkeypatch.setattr(store, "pull", counting_pull)
    for _ in range(5):
        clock.now += 0.1
        coord.tick()
    assert pulls == [retry.DELAY_TOPIC]  # the tick every 100 ms does not read it again
    clock.now += 0.6
    coord.tick()
    assert pulls == [retry.DELAY_TOPIC] * 2
    assert len(everything(store, RETRY)) == 1


@pytest.mark.parametrize("damaged", [False, True], ids=["control", "damaged"])
def test_a_damaged_mover_file_is_said_at_start(
    tmp_path: Path, damaged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        retry.Retries(store).commit_cursors({(retry.DELAY_TOPIC, 0): 0}, None)
    if damaged:
        (path / "consumers" / f"{retry.MOVER_GROUP}.json").write_text("nonsense")
    with MessageStore.open(path) as store, caplog.at_level("WARNING", "equeue.retry"):
        retry.Retries(store)
    said = [r.getMessage() for r in caplog.records if r.name == "equeue.retry"]
    assert bool(said) is damaged
    assert all("delivered again" in text for text in said)


def test_a_lost_mover_file_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """review19 R19-4: deleted (the checkpoint names it: grouprecord.py), not only damaged,
    the mover's cursors are gone and what it had moved comes again: it says so."""
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        retry.Retries(store).commit_cursors({(retry.DELAY_TOPIC, 0): 0}, None)
        store.flush()  # a checkpoint recording the group file
    (path / "consumers" / f"{retry.MOVER_GROUP}.json").unlink()
    with MessageStore.open(path) as store, caplog.at_level("WARNING", "equeue.retry"):
        retry.Retries(store)
    said = [r.getMessage() for r in caplog.records if r.name == "equeue.retry"]
    assert len(said) == 1 and "were lost" in said[0] and "delivered again" in said[0], said


def test_a_message_whose_dead_letter_cannot_fit_is_dead_lettered_cut(
    tmp_path: Path, clock: Clock
) -> None:
    """The store now allows 64 bytes of properties: neither the retry copy nor the
    reduced dead letter fits. The nack still ends in a dead letter (before: it raised
    MessageTooLargeError, and the message came back to fail again, for ever)."""
    from equeue import StoreConfig

    with MessageStore.open(tmp_path / "s", StoreConfig(max_properties_size=64)) as store:
        store.create_topic("orders", 1)
        coord = coordinator(store, clock)
        sent = store.send("orders", b"pay", key="k")
        coord.nack("g", "a", sent.message_id, None)
        (dead,) = everything(store, DLQ)
        assert (dead.body, dead.key) == (b"pay", "k")
        assert dead.properties[retry.ORIGIN_ID] == sent.message_id
        assert retry.DLQ_BODY_SIZE not in dead.properties  # the body is whole
        assert everything(store, retry.DELAY_TOPIC) == []


def test_a_body_past_a_lowered_max_message_size_is_dead_lettered_cut(
    tmp_path: Path, clock: Clock
) -> None:
    """A message stored before the store was reopened with a smaller max_message_size:
    its dead letter carries the body cut to the limit and its size as it was."""
    from equeue import StoreConfig

    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("orders", 1)
        sent = store.send("orders", b"b" * 3000, properties={"user": "1"})
        small = store.send("orders", b"s" * 10)
    with MessageStore.open(tmp_path / "s", StoreConfig(max_message_size=1000)) as store:
        coord = coordinator(store, clock)
        coord.nack("g", "a", sent.message_id, None)
        coord.nack("g", "a", small.message_id, None)  # control: it fits, a delayed retry
        (dead,) = everything(store, DLQ)
        assert dead.body == b"b" * 1000
        assert dead.properties[retry.DLQ_BODY_SIZE] == "3000"
        assert dead.properties[retry.ORIGIN_ID] == sent.message_id
        assert dead.properties[retry.ORIGIN_OFFSET] == "0"
        assert "cut to the store's limits" in dead.properties[retry.DLQ_REASON]
        assert [m.body for m in everything(store, retry.DELAY_TOPIC)] == [b"s" * 10]


def test_mover_persists_off_the_loop_and_moves_nothing_more_until_durable(
    store: MessageStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the broker runs it (persist_with: its committer thread): the tick appends the
    copies, the fdatasync then the cursors run on the other thread, and until they ended
    no tick moves anything (the copies would be moved twice)."""
    coord = coordinator(store, clock)
    for delay_ms in (1000, 5000, 30_000):
        coord.nack("g", "a", store.send("orders", b"x").message_id, delay_ms)
    executor = concurrent.futures.ThreadPoolExecutor(1, "mover-test")
    gate = threading.Event()
    calls: list[tuple[str, str]] = []

    def record(name: str, real: Any, wait: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, threading.current_thread().name))
            if wait:
                assert gate.wait(10.0)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(store, "flush_log", record("flush_log", store.flush_log, wait=True))
    monkeypatch.setattr(store, "send_batch", record("send_batch", store.send_batch))
    monkeypatch.setattr(
        coord.retries, "commit_cursors", record("commit", coord.retries.commit_cursors)
    )
    try:
        coord.persist_with(lambda work: executor.submit(work))
        clock.now += 31.0
        assert coord.retries.move_due() == 3
        here = threading.current_thread().name
        assert calls[:3] == [("send_batch", here)] * 3
        assert coord.retries.move_due() == 0  # the fdatasync is held: nothing moves again
        assert [store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, q) for q in
                range(3)] == [None] * 3  # fmt: skip
        gate.set()
        deadline = time.monotonic() + 10.0
        while len(calls) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        executor.shutdown(wait=True)
        assert calls[3:] == [("flush_log", "mover-test_0"), ("commit", "mover-test_0")]
        assert coord.retries.move_due() == 0  # done: the cursors advance, nothing is due
        assert [m.body for m in everything(store, RETRY)] == [b"x"] * 3
        assert [store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, q) for q in
                range(3)] == [1, 1, 1]  # fmt: skip
    finally:
        gate.set()
        executor.shutdown(wait=True)


def test_a_move_that_failed_off_the_loop_is_written_again_not_moved_again(
    store: MessageStore, clock: Clock, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The cursor write fails on the other thread: the failure is logged, the next tick
    writes the cursor again and moves nothing until it is written (before: the copies
    were moved again, a duplicate with no crash)."""
    coord = coordinator(store, clock)
    coord.nack("g", "a", store.send("orders", b"m").message_id, 1000)
    executor = concurrent.futures.ThreadPoolExecutor(1, "mover-test")

    def fail(*args: object) -> None:
        raise StoreWriteError(5, "simulated failure before the cursor is committed")

    try:
        coord.persist_with(lambda work: executor.submit(work))
        monkeypatch.setattr(coord.retries, "commit_cursors", fail)
        clock.now += 1.0
        assert coord.retries.move_due() == 1
        executor.submit(lambda: None).result(10.0)  # the failed job ended before it
        monkeypatch.undo()
        assert coord.retries.move_due() == 0  # the write again, off the loop
        executor.submit(lambda: None).result(10.0)
        assert coord.retries.move_due() == 0
        assert [m.body for m in everything(store, RETRY)] == [b"m"]
        assert "could not make its move durable" in caplog.text
        assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, 0) == 1
    finally:
        executor.shutdown(wait=True)


def test_a_repeat_nack_of_one_message_makes_no_second_copy(
    store: MessageStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # reviewg F14: 200 nacks of one message made 200 retry copies, each delivered again
    coord = coordinator(store, clock)
    first = store.send("orders", b"one")
    for _ in range(5):
        coord.nack("g", "a", first.message_id, 0)
    assert [m.body for m in everything(store, RETRY)] == [b"one"]  # (delay 0: no wait)
    assert coord.retries.stats()["nacked_again"] == 4
    # another group's nack of the same message is its own
    coord.join("h", "b", ["orders"], 600_000)
    coord.nack("h", "b", first.message_id, 0)
    assert [m.body for m in everything(store, retry.retry_topic("h"))] == [b"one"]
    # the memory is bounded: a message forgotten is copied again when nacked again
    monkeypatch.setattr(retry, "NACKS_REMEMBERED", 3)
    others = [store.send("orders", b"other %d" % i) for i in range(3)]
    for sent in others:
        coord.nack("g", "a", sent.message_id, 0)
    coord.nack("g", "a", first.message_id, 0)  # forgotten: ("h", first) and 3 newer
    assert [m.body for m in everything(store, RETRY)].count(b"one") == 2
    assert coord.retries.stats()["nacked_again"] == 4


def _retry_copy(properties: dict[str, str]) -> Message:
    return Message("0" * 24, RETRY, 0, 7, 0, "", None, properties, 0, b"copy", 1, 1)


_GOOD = {
    retry.ATTEMPT: "2",
    retry.ORIGIN_TOPIC: "orders",
    retry.ORIGIN_QUEUE: "1",
    retry.ORIGIN_OFFSET: "5",
    retry.ORIGIN_ID: "f" * 24,
}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (retry.ORIGIN_QUEUE, "-1"),
        (retry.ORIGIN_QUEUE, "1024"),  # MAX_QUEUES: no topic has that queue
        (retry.ORIGIN_QUEUE, "1" + "0" * 30),
        (retry.ORIGIN_QUEUE, "\u0663"),  # an Arabic-Indic 3: int() reads it
        (retry.ORIGIN_OFFSET, "-5"),
        (retry.ORIGIN_OFFSET, str(2**63)),
        (retry.ORIGIN_OFFSET, "1" + "0" * 30),
        (retry.ORIGIN_OFFSET, " 5"),
        (retry.ORIGIN_OFFSET, "9" * 5000),  # int() refuses it with a builtin ValueError
        (retry.ATTEMPT, "-5"),
        (retry.ATTEMPT, "1" + "0" * 30),
        (retry.ATTEMPT, str(MAX_RETRIES_LIMIT + 1)),
        (retry.ATTEMPT, "1_0"),
    ],
)
def test_retry_numbers_out_of_range_make_no_retry_copy(name: str, value: str) -> None:
    """A retry copy's numbers are the broker's: ASCII digits, a queue id below
    MAX_QUEUES, an offset below 2**63, an attempt at most MAX_RETRIES_LIMIT. One that is
    not (a message written into the retry topic by hand, or damaged) makes it no retry
    copy, as a property that does not parse does: the consumer sees it where it is, and
    a nack starts its attempts at 0 with it as its own origin. Before, int() took a
    negative or 31-digit queue id or offset into the restored message (and "\u0663" as
    3), and a 31-digit attempt dead-lettered it at once."""
    assert retry.origin(_retry_copy(_GOOD), "g") == (
        {k: _GOOD[k] for k in _GOOD if k != retry.ATTEMPT},
        2,
    )
    assert retry.restore(_retry_copy(_GOOD))[1:4] == ("orders", 1, 5)
    copy = _retry_copy(_GOOD | {name: value})
    if name != retry.ATTEMPT:  # the consumer's view: restore reads only the origin
        assert retry.restore(copy) == copy
    found, attempts = retry.origin(copy, "g")
    assert attempts == 0
    assert found == {
        retry.ORIGIN_TOPIC: RETRY,
        retry.ORIGIN_QUEUE: "0",
        retry.ORIGIN_OFFSET: "7",
        retry.ORIGIN_ID: "0" * 24,
    }
