"""What held long-poll pulls may keep (review4 R4, reviewg F13): one connection's tag
filters are kept once each and weigh at most max_held_filter_bytes; the broker holds at
most max_held_pulls; past either, a pull with a wait is answered empty at its offset
(nothing skipped) at the next tick, and counted; the 100 ms look at held pulls' queues looks at a
bounded number of them a tick, the retry mover's appends waking their pulls by note."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess
from server_helpers import Raw, raw, short_home

from equeue import MessageStore
from equeue.errors import ConfigError
from equeue.protocol.frames import encode
from equeue.server import BrokerThread, retry
from equeue.server.config import DEFAULT_MAX_HELD_FILTER_BYTES, ServerConfig
from equeue.server.groups import GroupCoordinator
from equeue.server.heldfilters import TAG_OVERHEAD
from equeue.server.holds import POLL_QUEUES, HeldPull, Holds
from equeue.store.types import PullResult

home = pytest.fixture(short_home, name="home")

DAY_MS = 86_400_000
TAG_BYTES = 255
FILTER_WEIGHT = 1024 * (TAG_BYTES + TAG_OVERHEAD)  # a filter of 1,024 tags of 255 bytes


def _tags(pull: int) -> list[str]:
    """1,024 tags of 255 bytes, distinct for each ``pull`` (the review's probe)."""
    return [f"{pull:06d}{j:05d}".ljust(TAG_BYTES, "t") for j in range(1024)]


def _pipeline(client: Raw, count: int, tags: Any, first_id: int = 1, offset: int = 0) -> None:
    pulls = (
        encode([first_id + n, "pull", {"topic": "t", "queue_id": 0, "offset": offset,
                "wait_ms": DAY_MS, "tags": tags(n) if callable(tags) else tags}])
        for n in range(count)
    )  # fmt: skip
    client.send_raw(b"".join(pulls))


def _stats_when(client: Raw, field: str, value: int) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for _ in range(500):  # at most ~10 s: the broker reads the pipelined pulls meanwhile
        stats = client.call("stats")
        if stats[field] == value:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"{field} never became {value}: {stats}")


def test_one_connections_held_filters_weigh_at_most_its_bound(home: Path) -> None:
    """review4 R4 scaled down: ONE connection pipelines 40 day-long pulls, each with
    1,024 distinct tags of 255 bytes. Before: all 40 held, each keeping its tag list and
    a frozenset of it (~350 KB a pull; 1,000 of them +346 MB). Now (the default 1 MiB)
    three filters are kept and the other 37 pulls are answered empty at their
    offset; a send with a held pull's tag still answers that pull."""
    count = 40
    kept = DEFAULT_MAX_HELD_FILTER_BYTES // FILTER_WEIGHT
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as producer:
        producer.call("create_topic", topic="t", queue_count=1)
        with raw(running.urls[0]) as holder:
            _pipeline(holder, count, _tags)
            answers = holder.answers(count - kept)  # the ones not held come back now
            stats = _stats_when(producer, "pulls_not_held", count - kept)
            assert stats["held_pulls"] == kept == 3
            assert stats["held_filter_bytes"] == kept * FILTER_WEIGHT
            assert stats["held_filter_bytes"] <= DEFAULT_MAX_HELD_FILTER_BYTES
            assert sorted(answers) == list(range(kept + 1, count + 1))  # the first 3 held
            for status, (messages, next_offset) in answers.values():
                assert (status, messages, next_offset) == (0, [], 0)
            producer.call("send", topic="t", body=b"m", tag=_tags(1)[7])  # pull 2's tag
            ((rid, (status, (messages, next_offset))),) = holder.answers(1).items()
            assert (rid, status, len(messages), next_offset) == (2, 0, 1, 1)
            stats = producer.call("stats")
            assert stats["held_pulls"] == kept - 1
            assert stats["held_filter_bytes"] == (kept - 1) * FILTER_WEIGHT
        # the connection closed: its filters are forgotten with its pulls
        stats = _stats_when(producer, "held_pulls", 0)
        assert stats["held_filter_bytes"] == 0


def test_a_filter_shared_by_a_connections_pulls_is_kept_once(home: Path) -> None:
    """The library's consumer sends its one filter with each of its long polls (up to
    64): 100 pulls of one 1,024-tag filter are all held and weigh one filter."""
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as producer:
        producer.call("create_topic", topic="t", queue_count=1)
        with raw(running.urls[0]) as holder:
            _pipeline(holder, 100, _tags(0))
            stats = _stats_when(producer, "held_pulls", 100)
            assert stats["held_filter_bytes"] == FILTER_WEIGHT
            assert stats["pulls_not_held"] == 0
            producer.call("send", topic="t", body=b"m", tag=_tags(0)[0])
            answers = holder.answers(100)
            assert all(len(payload[0]) == 1 for _, payload in answers.values())
            assert producer.call("stats")["held_filter_bytes"] == 0


def test_max_held_pulls_bounds_every_connections_held_pulls(home: Path) -> None:
    """--max-held-pulls 10, two connections pipelining 8 day-long pulls each: 10 held,
    6 answered empty (next_offset their offset); a send answers the 10 held;
    then there is room for pulls to be held again."""
    with BrokerThread(home / "s", max_held_pulls=10) as running:
        url = running.urls[0]
        with raw(url) as producer, raw(url) as first, raw(url) as second:
            producer.call("create_topic", topic="t", queue_count=1)
            _pipeline(first, 8, None)
            _stats_when(producer, "held_pulls", 8)
            _pipeline(second, 8, None)
            not_held = second.answers(6)
            assert sorted(not_held) == list(range(3, 9))  # its first 2 are held
            assert all(answer == (0, [[], 0]) for answer in not_held.values())
            stats = _stats_when(producer, "pulls_not_held", 6)
            assert stats["held_pulls"] == 10
            producer.call("send", topic="t", body=b"m")
            for client, held in ((first, 8), (second, 2)):
                for status, (messages, next_offset) in client.answers(held).values():
                    assert (status, len(messages), next_offset) == (0, 1, 1)
            _pipeline(first, 3, None, first_id=100, offset=1)
            stats = _stats_when(producer, "held_pulls", 3)
            assert stats["pulls_not_held"] == 6


def test_a_pull_not_held_is_answered_at_the_next_tick_not_at_once(home: Path) -> None:
    """A client that pulls again as soon as a long poll comes back empty (the library's
    consumer) must not spin past the bound: answered at once, one idle consumer of 4
    queues made 5,600 pulls a second. A pull not held and a ping in one read: the ping
    (answered within the read) comes first, the pull at the broker's next tick; before,
    the pull's answer came first."""
    with BrokerThread(home / "s", max_held_pulls=0) as running, raw(running.urls[0]) as client:
        client.call("create_topic", topic="t", queue_count=1)
        pull = {"topic": "t", "queue_id": 0, "offset": 0, "wait_ms": DAY_MS}
        client.send_raw(encode([10, "pull", pull]) + encode([11, "ping", {}]))
        assert [client.recv()[0], client.recv()[0]] == [11, 10]
        assert client.call("stats")["pulls_not_held"] == 1


def test_equeue_serve_takes_both_bounds(home: Path) -> None:
    """The real ``equeue serve --max-held-pulls 2 --max-held-filter-bytes 0``: two of
    three pulls held, a pull with a filter and a pull_columns past the bound answered at
    once; a bound out of range is refused at start, naming its option."""
    broker = BrokerProcess(home / "s", "--max-held-pulls", "2", "--max-held-filter-bytes", "0")
    try:
        with raw(broker.url) as producer, raw(broker.url) as holder:
            producer.call("create_topic", topic="t", queue_count=1)
            _pipeline(holder, 1, ["a"])  # held without room for its filter: answered
            assert holder.answers(1) == {1: (0, [[], 0])}
            _pipeline(holder, 3, None, first_id=2)
            assert holder.answers(1) == {4: (0, [[], 0])}
            rid = holder.request(
                "pull_columns", topic="t", queue_id=0, offset=0, wait_ms=DAY_MS
            )  # fmt: skip
            ((got, (status, _)),) = holder.answers(1).items()
            assert (got, status) == (rid, 0)
            stats = producer.call("stats")
            assert (stats["held_pulls"], stats["pulls_not_held"]) == (2, 3)
            assert stats["held_filter_bytes"] == 0
    finally:
        broker.stop()
    done = subprocess.run(
        [sys.executable, "-m", "equeue", "serve", str(home / "t"), "--max-held-pulls", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "--max-held-pulls" in done.stderr, done
    with pytest.raises(ConfigError, match="--max-held-filter-bytes"):
        ServerConfig(max_held_filter_bytes=1 << 40)


class _CountingStore:
    """A store whose queue_range calls are counted."""

    def __init__(self, store: MessageStore) -> None:
        self.store = store
        self.ranges = 0

    def queue_range(self, topic: str, queue_id: int) -> tuple[int, int]:
        self.ranges += 1
        return self.store.queue_range(topic, queue_id)

    def pull(self, *args: Any, **kwargs: Any) -> PullResult:
        return self.store.pull(*args, **kwargs)


class _Owner:
    where = "connection #1"

    def has_room(self) -> bool:
        return True


def test_the_look_at_held_pulls_queues_is_bounded_a_tick(tmp_path: Path) -> None:
    """reviewg F13: 2,048 queues with a held pull each. Before, every 100 ms tick called
    queue_range on all 2,048 (20,400: 9.4 % of a core, idle); now on POLL_QUEUES a tick,
    and an append nobody noted is still found within a round of them."""
    queues = 2048
    loop = asyncio.new_event_loop()
    answered: list[tuple[HeldPull, object]] = []
    try:
        with MessageStore.open(tmp_path / "s") as store:
            for topic in ("a", "b"):
                store.create_topic(topic, 1024)
            counting = _CountingStore(store)
            holds = Holds(loop, counting, lambda held, outcome: answered.append((held, outcome)))  # type: ignore[arg-type]
            owner = _Owner()
            args = {"max_count": 32, "max_bytes": 1 << 20}
            for n in range(queues):
                key = ("a" if n < 1024 else "b", n % 1024)
                assert holds.hold(HeldPull(owner, n + 1, key, 0, args), None, 3600.0)
            holds.poll()
            assert counting.ranges == POLL_QUEUES < queues
            store.send("b", b"x", queue_id=500)  # not noted: only the look finds it
            rounds = -(-queues // POLL_QUEUES)
            for _ in range(rounds):
                holds.poll()
            assert counting.ranges == (rounds + 1) * POLL_QUEUES
            ((held, outcome),) = answered
            assert held.key == ("b", 500)
            assert isinstance(outcome, PullResult) and len(outcome.messages) == 1
            holds.drop(owner)
    finally:
        loop.close()


def test_a_moved_retry_answers_a_held_pull_without_the_look(home: Path) -> None:
    """The mover's copy wakes a long poll held on the retry topic in the tick that moves
    it, by its note: with the look at held queues (``Holds.poll``) made a no-op, the pull
    is answered with the copy all the same. Before, only the look found it: the pull
    waited its 60 s (the client's 20 s socket timeout ends the test first)."""
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as member:
        running.broker.holds.poll = lambda: None  # type: ignore[method-assign]
        member.call("create_topic", topic="t", queue_count=1)
        member.call("join", group="g", consumer="a", topics=["t"], session_timeout_ms=60_000)
        sent = member.call("send", topic="t", body=b"again")
        with raw(running.urls[0]) as holder:
            rid = holder.request(
                "pull", topic=retry.retry_topic("g"), queue_id=0, offset=0, wait_ms=60_000
            )  # fmt: skip
            _stats_when(member, "held_pulls", 1)
            member.call("nack", group="g", consumer="a", message_id=sent[0], delay_ms=1)
            ((got, (status, (messages, next_offset))),) = holder.answers(1).items()
            assert (got, status, next_offset) == (rid, 0, 1)
            assert messages[0][9] == b"again"  # (the body)


def test_the_retry_movers_appends_are_noted_for_held_pulls(tmp_path: Path) -> None:
    """A copy the mover appends (a nack without a delay, a delayed one moved, a dead
    letter) tells ``appended`` where, so the held pulls of its queue are pulled at once,
    not when the look at held queues comes round to it."""

    class Clock:
        now = 1_700_000_000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    noted: list[tuple[str, int, int, str]] = []
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 1)
        coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=(1.0,))
        coord.retries.appended = lambda *where: noted.append(where)
        coord.join("g", "a", ["t"], 600_000)
        first = store.send("t", b"now", tag="x").message_id
        later = store.send("t", b"later", tag="y").message_id
        coord.nack("g", "a", first, 0)  # straight to the retry topic
        coord.nack("g", "a", later, 1000)  # to the delay topic, moved at a tick
        clock.now += 1.5
        coord.tick()
        retry_topic = retry.retry_topic("g")
        assert (retry_topic, 0, 0, "x") in noted
        assert (retry.DELAY_TOPIC, 0, 0, "y") in noted
        assert (retry_topic, 0, 1, "y") in noted
        assert len(noted) == 3
