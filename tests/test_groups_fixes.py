"""Review fixes of issue 23's groups and retries, through a real broker (BrokerThread on a
Unix socket): a nack that failed is redelivered, never committed past; the broker's
reserved ``equeue.*`` names refuse clients' writes but stay readable; ``client.consumer``;
a message whose properties fill the limit is dead-lettered, not lost."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from group_helpers import broker_thread

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer, _Inline
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.sync import Client
from equeue.errors import ConnectionLostError, InvalidMessageError
from equeue.protocol.retries import (
    DELAY_TOPIC,
    MOVER_GROUP,
    ORIGIN_ID,
    dead_letter_topic,
    retry_topic,
)
from equeue.server.handlers import DEFERRED, Handlers

TOPIC = "one"


@pytest.fixture
def url() -> Iterator[str]:
    with broker_thread(TOPIC, 1) as url:
        yield url


class NackLostOnce:
    """The client, but the first nack fails as a broker restart fails it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.url: str = client.url
        self.failed = 0

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        if op == "nack" and not self.failed:
            self.failed += 1
            raise ConnectionLostError(f"{self.url}: the connection was lost (test)")
        return self.client.request(op, arguments)


def test_a_nack_that_failed_is_redelivered_not_committed(url: str) -> None:
    handled: list[bytes] = []

    def handler(message: equeue.Message) -> None:
        handled.append(message.body)
        if message.body == b"m1" and handled.count(b"m1") == 1:
            raise ValueError("the first m1 fails")

    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m0", b"m1", b"m2"])
        flaky = NackLostOnce(client)
        consumer = GroupConsumer(flaky, "g", TOPIC, session_timeout=3.0)
        try:
            with pytest.raises(ConnectionLostError):
                consumer.run(handler, timeout=5.0)
            assert flaky.failed == 1
            assert client.committed_offset("g", TOPIC, 0) in (None, 0, 1)  # not past m1
            consumer.run(handler, timeout=1.0)  # as a supervisor would call it again
        finally:
            consumer.close()
        assert handled.count(b"m1") == 2  # the failed nack's message came again
        assert handled[-1] == b"m2"
        assert client.committed_offset("g", TOPIC, 0) == 3
        assert client.queue_range(retry_topic("g"), 0) == (0, 0)


def test_closed_after_a_failed_nack_it_leaves_uncommitted(url: str) -> None:
    """Closed right after its nack failed: it commits nothing (the message would be
    committed past), but leaves, so its queues go on now, not a session timeout later."""
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m0", b"m1"])
        consumer = GroupConsumer(NackLostOnce(client), "g", TOPIC, session_timeout=60.0)
        try:
            first = consumer.poll(5.0)
            assert first is not None and first.body == b"m0"
            with pytest.raises(ConnectionLostError):
                consumer.nack(first)
        finally:
            consumer.close()
        assert "g" not in client.stats()["coordinator"]
        assert client.committed_offset("g", TOPIC, 0) is None
        with client.consumer("g", TOPIC, timeout=1.0) as again:
            assert [m.body for m in again] == [b"m0", b"m1"]


def test_a_nack_that_failed_is_redelivered_asyncio(url: str) -> None:
    class AsyncNackLostOnce:
        def __init__(self, client: Any) -> None:
            self.client, self.url, self.failed = client, client.url, 0

        async def request(self, op: str, arguments: dict[str, Any]) -> Any:
            if op == "nack" and not self.failed:
                self.failed += 1
                raise ConnectionLostError(f"{self.url}: the connection was lost (test)")
            return await self.client.request(op, arguments)

    handled: list[bytes] = []

    def handler(message: equeue.Message) -> None:
        handled.append(message.body)
        if message.body == b"m1" and handled.count(b"m1") == 1:
            raise ValueError("the first m1 fails")

    async def main() -> None:
        client = await equeue.aio.connect(url)
        try:
            await client.send_batch(TOPIC, [b"m0", b"m1", b"m2"])
            consumer = AsyncGroupConsumer(AsyncNackLostOnce(client), "g", TOPIC)
            async with consumer:
                with pytest.raises(ConnectionLostError):
                    await consumer.run(handler, timeout=5.0)
                await consumer.run(handler, timeout=1.0)
            assert await client.committed_offset("g", TOPIC, 0) == 3
        finally:
            await client.close()

    asyncio.run(main())
    assert handled.count(b"m1") == 2 and handled[-1] == b"m2"


def test_client_consumer_methods(url: str) -> None:
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"a", b"b"])
        with client.consumer("g", TOPIC, session_timeout=2.0, timeout=1.0) as consumer:
            assert isinstance(consumer, GroupConsumer)
            assert [m.body for m in consumer] == [b"a", b"b"]
        assert client.committed_offset("g", TOPIC, 0) == 2

    async def main() -> list[bytes]:
        client = await equeue.aio.connect(url)
        try:
            await client.send(TOPIC, b"c")
            consumer = client.consumer("h", [TOPIC], timeout=1.0)
            assert isinstance(consumer, AsyncGroupConsumer)
            async with consumer:
                return [m.body async for m in consumer]
        finally:
            await client.close()

    assert asyncio.run(main()) == [b"a", b"b", b"c"]


def test_reserved_names_refuse_client_writes_and_stay_readable(url: str) -> None:
    with equeue.connect(url) as client:
        client.send(TOPIC, b"poison")
        with client.consumer("g", TOPIC, max_retries=0, timeout=2.0) as consumer:
            message = next(iter(consumer))
            consumer.nack(message)  # max_retries=0: straight to the dead-letter topic
        dlq = dead_letter_topic("g")
        topics = client.topics()
        ranges = {t: client.queue_range(t, 0) for t in topics}
        refused: list[Callable[[], object]] = [
            lambda: client.send(DELAY_TOPIC, b"forged", properties={"equeue.group": "g"}),
            lambda: client.send(retry_topic("g"), b"forged"),
            lambda: client.send(dlq, b"forged"),
            lambda: client.send_batch(DELAY_TOPIC, [b"forged"]),
            lambda: client.create_topic("equeue.mine", 1),
            lambda: client.commit_offset(MOVER_GROUP, DELAY_TOPIC, 0, 0),
            lambda: client.commit_offset("g", DELAY_TOPIC, 0, 0),
            lambda: client.commit_offset("other", retry_topic("g"), 0, 0),
            lambda: client.consumer("equeue.mover", TOPIC),
            lambda: client.consumer("x", DELAY_TOPIC),
            lambda: client.consumer("x", retry_topic("g")),
        ]
        for call in refused:
            with pytest.raises(InvalidMessageError, match=r"reserved|broker"):
                call()
        assert client.topics() == topics  # nothing changed
        assert {t: client.queue_range(t, 0) for t in topics} == ranges
        # reads: the dead letters are an ordinary topic, consumed by a group of its own
        (dead,) = client.pull(dlq, 0, 0).messages
        assert dead.body == b"poison" and dead.properties[ORIGIN_ID] == message.message_id
        client.commit_offset("g", retry_topic("g"), 0, 0)  # its own group's retry offsets
        with client.consumer("dead", dlq, timeout=1.0) as reader:
            assert [m.body for m in reader] == [b"poison"]
        assert client.committed_offset("dead", dlq, 0) == 1


def test_properties_at_the_limit_are_dead_lettered_not_lost(url: str) -> None:
    big = "v" * 32_763  # with its key, the store's max_properties_size (32768) exactly
    with equeue.connect(url) as client:
        client.send(TOPIC, b"big", properties={"k": big})
        client.send(TOPIC, b"next")
        with client.consumer("g", TOPIC, timeout=1.0) as consumer:
            first = next(iter(consumer))
            consumer.nack(first, delay=0)
            assert [m.body for m in consumer] == [b"next"]
        (dead,) = client.pull(dead_letter_topic("g"), 0, 0).messages
        assert dead.body == b"big"
        assert dead.properties[ORIGIN_ID] == first.message_id
        assert "equeue.dlq.reason" in dead.properties
        assert client.committed_offset("g", TOPIC, 0) == 2
        assert client.queue_range(retry_topic("g"), 0) == (0, 0)  # delay=0: it would be there


class Recorder:
    """The client, recording every pull's arguments and the pulls in flight at once."""

    def __init__(self, client: Any) -> None:
        self.client, self.url = client, client.url
        self.pulls: list[dict[str, Any]] = []
        self.inflight = self.most = 0

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        if op not in ("pull", "pull_columns"):  # (pull_columns: protocol version 3)
            return self.client.request(op, arguments)
        self.pulls.append(arguments)
        self.inflight += 1  # the GIL makes these counts exact enough for a maximum
        self.most = max(self.most, self.inflight)
        try:
            return self.client.request(op, arguments)
        finally:
            self.inflight -= 1


def test_a_member_of_many_queues_long_polls_them_in_turns(url: str) -> None:
    queues = 70  # past MAX_POLLERS (64): they were pulled without a wait, ~11 k pulls/s
    with equeue.connect(url) as client:
        client.create_topic("wide", queues)
        recorder = Recorder(client)
        with GroupConsumer(recorder, "g", "wide") as consumer:
            assert consumer.poll(0.5) is None
            idle = list(recorder.pulls)
            client.send("wide", b"last", queue_id=queues - 1)
            got = consumer.poll(10.0)  # within a round of turns (~1 s); bounded
            assert got is not None and got.body == b"last"
        assert idle and all(p.get("wait_ms", 0) > 0 for p in idle)
        assert recorder.most <= 64
        assert client.committed_offset("g", "wide", queues - 1) == 1

    async def main() -> tuple[int, list[dict[str, Any]]]:
        aclient = await equeue.aio.connect(url)
        pulls: list[dict[str, Any]] = []
        most = inflight = 0

        class AsyncRecorder:
            def __init__(self) -> None:
                self.url = aclient.url

            async def request(self, op: str, arguments: dict[str, Any]) -> Any:
                nonlocal most, inflight
                if op in ("pull", "pull_columns"):
                    pulls.append(arguments)
                    inflight += 1
                    most = max(most, inflight)
                try:
                    return await aclient.request(op, arguments)
                finally:
                    if op in ("pull", "pull_columns"):
                        inflight -= 1

        try:
            async with AsyncGroupConsumer(AsyncRecorder(), "h", "wide") as consumer:
                assert await consumer.poll(0.5) is None
        finally:
            await aclient.close()
        return most, pulls

    most, pulls = asyncio.run(main())
    assert pulls and all(p.get("wait_ms", 0) > 0 for p in pulls)
    assert most <= 64


@pytest.mark.parametrize("how", ["wrapper", "inline"])
def test_the_blocking_member_sends_no_long_poll_while_messages_are_at_hand(
    url: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 30a, finding 3: the pull sent right after an answer filled the buffer (at
    offset 32, 32 messages at hand) was a 1 s long poll; it goes without a wait, and
    long polls are left to a member with nothing at hand (the first pull here). Through
    a wrapper (its request sees every pull: pool threads) and through the Client itself
    (review 33a, 5: the pull at 32 written by the loop's own thread, start_request)."""
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m%d" % i for i in range(40)])
        recorder = Recorder(client)
        inline: list[dict[str, Any]] = []
        requester: Any = recorder
        if how == "inline":  # the class's own methods, recording: still the exact Client
            start_request, request = Client.start_request, Client.request

            def recording(self: Client, op: str, arguments: dict[str, Any]) -> Any:
                if op == "pull_columns":
                    inline.append(arguments)
                return start_request(self, op, arguments)

            def by_request(self: Client, op: str, arguments: dict[str, Any]) -> Any:
                if op == "pull_columns":
                    recorder.pulls.append(arguments)
                return request(self, op, arguments)

            monkeypatch.setattr(Client, "start_request", recording)
            monkeypatch.setattr(Client, "request", by_request)
            requester = client
        with GroupConsumer(requester, "g", TOPIC, batch_size=32) as consumer:
            got = [consumer.poll(5.0) for _ in range(40)]
        assert [m.body for m in got if m is not None] == [b"m%d" % i for i in range(40)]
        pulls = [(p["offset"], p.get("wait_ms", 0)) for p in recorder.pulls if p["topic"] == TOPIC]
        if how == "inline":
            written = [(p["offset"], p.get("wait_ms", 0)) for p in inline if p["topic"] == TOPIC]
            assert (32, 0) in written  # the loop's own thread wrote it
            pulls = sorted(pulls + written)
        else:
            assert not inline
        assert pulls[0] == (0, 1000)  # nothing at hand: a long poll (POLL_WAIT_MS)
        assert [wait for at, wait in pulls if at == 32] == [0]  # 32 at hand: no wait


def test_run_stops_at_max_messages_and_iteration_goes_on_from_there(url: str) -> None:
    """run() and iteration share one generator (poll's common case inline): run stops
    after max_messages without polling the next (its last message stays in hand until
    commit), max_messages=0 takes none, and iteration then goes on in order."""
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"%d" % i for i in range(10)])
        seen: list[bytes] = []
        with GroupConsumer(client, "runs", TOPIC, batch_size=4, timeout=0.5) as consumer:
            assert consumer.run(lambda m: seen.append(m.body), max_messages=3) == 3
            assert consumer.run(lambda m: seen.append(m.body), max_messages=0) == 0
            assert seen == [b"0", b"1", b"2"]
            consumer.commit()  # the third, in hand, counts as processed now
            assert client.committed_offset("runs", TOPIC, 0) == 3
            assert [m.body for m in consumer] == [b"%d" % i for i in range(3, 10)]
        assert client.committed_offset("runs", TOPIC, 0) == 10


def test_a_long_poll_written_while_busy_still_wakes_the_idle_loop(url: str) -> None:
    """A queue found drained while messages are at hand is long-polled from the loop's own
    thread (start_request, no pool thread); once the buffer runs empty with only such
    long polls in flight, pool threads take them over, so a message arriving is handed
    out at once, not after a heartbeat (every 10 s here) happens to read the connection.
    (Before the take-over the last poll gave None: nobody read the answer.)"""
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"b%d" % i for i in range(20)])  # batches of 8, 8, 4
        with GroupConsumer(
            client, "g2", TOPIC, batch_size=8, session_timeout=30.0, auto_commit=False
        ) as consumer:  # (no commit request to read the connection meanwhile)
            got = [consumer.poll(5.0)]
            # meanwhile the retry queue's first long poll (from a pool thread, nothing was
            # at hand then) ends: its next one, as TOPIC's after the batch of 4, is inline
            time.sleep(1.5)
            got += [consumer.poll(5.0) for _ in range(19)]
            assert [m.body for m in got if m is not None] == [b"b%d" % i for i in range(20)]
            late = threading.Timer(0.3, client.send, (TOPIC, b"late"))
            late.start()
            try:
                message = consumer.poll(3.0)
            finally:
                late.join()
            assert message is not None and message.body == b"late"


class OwnRequest(Client):
    """A Client whose own request counts the pulls (metrics, fault injection)."""

    pulls: list[dict[str, Any]]

    def request(self, op: str, arguments: dict[str, Any]) -> Any:
        if op == "pull_columns":
            self.pulls.append(arguments)
        return super().request(op, arguments)


def test_a_client_with_its_own_request_sees_every_pull(url: str) -> None:
    """Review 33a, 5: a subclass overriding request is not bypassed by the inline pulls
    (start_request): the pull at offset 32, written while messages are at hand, goes
    through its request too."""
    client = OwnRequest(url)
    client.pulls = []
    with client:
        client.send_batch(TOPIC, [b"m%d" % i for i in range(40)])
        with GroupConsumer(client, "g", TOPIC, batch_size=32) as consumer:
            got = [consumer.poll(5.0) for _ in range(40)]
        assert [m.body for m in got if m is not None] == [b"m%d" % i for i in range(40)]
        pulls = [(p["offset"], p.get("wait_ms", 0)) for p in client.pulls if p["topic"] == TOPIC]
        assert pulls[0] == (0, 1000)
        assert (32, 0) in pulls  # before the fix start_request wrote it: not seen here


def test_a_request_set_on_the_client_itself_sees_every_pull(url: str) -> None:
    """Review 33b, 3: a wrapper set on the instance (client.request = wrapper), not only a
    subclass's override, keeps the pulls on its request (the type alone said inline)."""
    seen: list[dict[str, Any]] = []
    with equeue.connect(url) as client:
        request = client.request

        def recording(op: str, arguments: dict[str, Any]) -> Any:
            seen.append(arguments)
            return request(op, arguments)

        client.request = recording  # type: ignore[method-assign]
        client.send_batch(TOPIC, [b"m%d" % i for i in range(40)])
        with GroupConsumer(client, "g", TOPIC, batch_size=32) as consumer:
            got = [consumer.poll(5.0) for _ in range(40)]
        assert [m.body for m in got if m is not None] == [b"m%d" % i for i in range(40)]
        pulls = [(p.get("offset"), p.get("wait_ms", 0)) for p in seen if p.get("topic") == TOPIC]
        assert (32, 0) in pulls  # before the fix start_request wrote it: not seen here


def test_poll_returns_at_its_timeout_while_the_loops_own_pull_is_answered_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 33a, 1: the buffer runs empty while the pull the loop's own thread wrote
    (no wait, at offset 32) is unanswered, the broker holding its answer back (released
    by the test, or by a timer 3 s on): poll(0.2) gives None before it is released
    (before the fix poll read on until the answer came: the timer's), and the late
    answer's messages come after, once each, in order."""
    pull_columns = Handlers.pull_columns
    late: list[Callable[[], None]] = []
    released = threading.Event()

    def slow(self: Handlers, peer: Any, rid: int, a: dict[str, Any]) -> Any:
        result = pull_columns(self, peer, rid, a)
        if (
            a.get("topic") == TOPIC
            and not a.get("wait_ms")
            and a.get("offset", 0) > 0
            and result is not DEFERRED
            and not late
        ):  # the loop's own pull at 32, held back (the broker's loop stays free)
            loop = asyncio.get_running_loop()

            def release() -> None:
                if not released.is_set():
                    released.set()
                    loop.call_soon_threadsafe(peer.finish, rid, result)

            late.append(release)
            return DEFERRED
        return result

    monkeypatch.setattr(Handlers, "pull_columns", slow)  # (before the broker takes it)
    with broker_thread(TOPIC, 1) as url, equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m%d" % i for i in range(40)])
        with GroupConsumer(client, "g", TOPIC, batch_size=32, session_timeout=30.0) as c:
            got = [c.poll(5.0) for _ in range(32)]
            timer = threading.Timer(3.0, lambda: [release() for release in late])
            timer.start()
            try:
                assert c.poll(0.2) is None
                assert late  # the loop's own pull at 32 was held back
                assert not released.is_set()  # poll(0.2) returned before the answer came
                # ... and left that pull the loop's own (review 33b, 1: handed to the pool,
                # it queued behind the long polls, a round per batch past 64 queues)
                kept = [p for p, _, _ in c._inflight.values() if type(p) is _Inline]
                assert [p.waits for p in kept] == [False]
                late[0]()
                got += [c.poll(5.0) for _ in range(8)]
                assert c.poll(0.3) is None  # nothing twice
            finally:
                timer.cancel()
        assert [m.body for m in got if m is not None] == [b"m%d" % i for i in range(40)]


def test_a_news_flag_set_after_the_answer_was_settled_is_cleared(url: str) -> None:
    """Review 33a, 2: take() sets news after storing its answer, outside the lock, so the
    flag can come after the loop found that answer applied (_settled). The next
    _maintain clears it (it was left set: every message then went through _maintain
    until the next heartbeat), and a news flag with a new answer still settles it."""
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m%d" % i for i in range(200)])
        with GroupConsumer(client, "g", TOPIC, batch_size=50, session_timeout=30.0) as c:
            it = iter(c)
            got = [next(it).body]
            state = c.state
            assert c._settled is state.answer
            state.news = True  # the heartbeat thread's late store of the flag
            got += [next(it).body for _ in range(100)]
            assert state.news is False  # (before the fix: still True)
            assert c._settled is state.answer
            with state.lock:  # a heartbeat's answer (a new object, equal): applied once
                assert state.answer is not None
                state.answer = dict(state.answer)
            state.news = True
            got += [next(it).body for _ in range(99)]
            assert state.news is False and c._settled is state.answer
        assert got == [b"m%d" % i for i in range(200)]
