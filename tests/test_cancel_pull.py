"""cancel_pull (protocol version 6, reviewk F4): a long poll whose caller gave up is
answered at once, its place under max_in_flight freed; a message appended as the pull
is cancelled is never lost (a pull only reads: the next pull from the same offset gets
it); an older broker is not asked, and its pulls hold their places as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from server_helpers import Raw, raw, short_home

import equeue.aio
from equeue.protocol.frames import check_answer, encode
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")

LONG_MS = 600_000  # a pull's wait no test waits for: it must be answered by cancel_pull
LONG_S = LONG_MS / 1000
GUARD_S = 60.0  # a test fails past this, far below LONG_S


def _pull(queue_id: int = 0, offset: int = 0) -> dict[str, object]:
    return {"topic": "t", "queue_id": queue_id, "offset": offset, "wait_ms": LONG_MS}


def _held(client: Raw, count: int) -> None:
    for _ in range(500):  # at most ~10 s
        if client.call("stats")["held_pulls"] == count:
            return
        time.sleep(0.02)
    raise AssertionError(f"held_pulls never became {count}")


@contextmanager
def _a_pull_held(home: Path) -> Iterator[tuple[Raw, Raw, int]]:
    """A broker whose topic t has 1 queue; a connection holding a pull of t/0 (and that
    pull's request id), and another connection."""
    with BrokerThread(home / "s") as running:
        running.store.create_topic("t", 1)
        url = running.urls[0]
        with raw(url) as c, raw(url) as other:
            pull = c.request("pull", **_pull())
            _held(other, 1)
            yield c, other, pull


def test_cancel_pull_answers_the_held_pull_empty_and_itself_true(home: Path) -> None:
    with _a_pull_held(home) as (c, watcher, pull):
        cancel = c.request("cancel_pull", request_id=pull)
        answers = c.answers(2)
        assert answers[pull] == (0, [[], 0])  # empty, next_offset its offset
        assert answers[cancel] == (0, True)
        assert watcher.call("stats")["held_pulls"] == 0
        # answered already, or never a held pull: False, nothing else answered
        assert c.call("cancel_pull", request_id=pull) is False
        assert c.call("cancel_pull", request_id=12345) is False
        # another connection's pull is not this connection's to cancel
        other = watcher.request("pull", **_pull())
        _held(c, 1)
        assert c.call("cancel_pull", request_id=other) is False
        cancel = watcher.request("cancel_pull", request_id=other)
        assert watcher.answers(2) == {other: (0, [[], 0]), cancel: (0, True)}


def test_cancel_pull_is_taken_at_max_in_flight(home: Path) -> None:
    """The places are all held pulls: cancel_pull, which holds nothing, is still served."""
    with BrokerThread(home / "s", max_in_flight=2) as running:
        running.store.create_topic("t", 2)
        url = running.urls[0]
        with raw(url) as c, raw(url) as watcher:
            first = c.request("pull", **_pull(0))
            second = c.request("pull", **_pull(1))
            _held(watcher, 2)
            refused = c.error("ping")  # the limit is there
            assert refused["code"] == "LimitExceededError"
            cancel = c.request("cancel_pull", request_id=first)
            assert c.answers(2) == {first: (0, [[], 0]), cancel: (0, True)}
            assert c.call("ping") is None  # a place came back
            cancel = c.request("cancel_pull", request_id=second)
            assert c.answers(2) == {second: (0, [[], 0]), cancel: (0, True)}
            _held(watcher, 0)


def test_cancel_pull_needs_version_6(home: Path) -> None:
    with BrokerThread(home / "s") as running:
        running.store.create_topic("t", 1)
        with raw(running.urls[0], versions=(1, 2, 3, 4, 5)) as old:
            old.request("cancel_pull", request_id=1)
            rid, status, payload = check_answer(old.recv(), "t")
            assert (rid, status, payload["code"]) == (0, 1, "ProtocolError")
            assert "op 'cancel_pull' is of protocol version 6" in payload["message"]


@pytest.mark.parametrize("message_first", [True, False], ids=["message-first", "cancel-first"])
def test_a_message_arriving_as_the_pull_is_cancelled_is_pulled_again(
    home: Path, message_first: bool
) -> None:
    """Both orders on the broker's loop: the message answers the held pull before the
    cancel is read (the cancel then finds nothing: False), or the cancel answers it
    empty first. Either way the message is in the queue for the next pull from the
    same offset (the client drops a cancelled pull's answer)."""
    with _a_pull_held(home) as (c, producer, pull):
        if message_first:
            producer.call("send", topic="t", body=b"m", queue_id=0)
            got = check_answer(c.recv(), "t")
            assert got[0] == pull and [m[9] for m in got[2][0]] == [b"m"]
            assert c.call("cancel_pull", request_id=pull) is False
        else:
            cancel = c.request("cancel_pull", request_id=pull)
            assert c.answers(2) == {pull: (0, [[], 0]), cancel: (0, True)}
            producer.call("send", topic="t", body=b"m", queue_id=0)
        again = c.call("pull", topic="t", queue_id=0, offset=0)
        assert [m[9] for m in again[0]] == [b"m"]


async def _give_up(client: equeue.aio.AsyncClient, count: int) -> int:
    """reviewk's loop: wait_for around a long poll on an empty queue, given up at once."""
    given_up = 0
    for _ in range(count):
        try:
            await asyncio.wait_for(client.pull("t", 0, 0, wait=LONG_S), 0.01)
        except TimeoutError:
            given_up += 1
    return given_up


def test_the_reviewk_reproduction_a_send_does_not_wait_behind_given_up_pulls(
    home: Path,
) -> None:
    """reviewk F4 at --max-in-flight 8: 10 pulls of a 600 s wait given up by wait_for
    after 0.01 s, then a send. Before, the send waited for the pulls' 600 s (reviewk:
    19.58 s at a 20 s wait); now each give-up frees its place within a round trip."""

    async def run(url: str) -> tuple[int, int, int]:
        async with await equeue.aio.connect(url) as client:
            given_up = await _give_up(client, 10)
            result = await asyncio.wait_for(client.send("u", b"after"), GUARD_S)
            stats = await client.stats()
            return given_up, result.queue_offset, stats["held_pulls"]

    with BrokerThread(home / "s", max_in_flight=8) as running:
        running.store.create_topic("t", 1)
        given_up, offset, held = asyncio.run(run(running.urls[0]))
    assert (given_up, offset, held) == (10, 0, 0)


def test_against_a_version_5_broker_given_up_pulls_keep_their_places(home: Path) -> None:
    """The fallback: nothing sent (the broker would close the connection for an op of
    version 6), so the pulls given up stay held until their wait ends, as before."""

    async def run(url: str) -> tuple[int, int, int]:
        async with await equeue.aio.connect(url) as client:
            assert client.welcome is not None and client.welcome.version == 5
            given_up = await _give_up(client, 5)
            await asyncio.wait_for(client.send("u", b"after"), GUARD_S)  # places are left
            stats = await client.stats()
            return given_up, stats["held_pulls"], stats["connections"]

    with BrokerThread(home / "s", max_in_flight=64) as running:
        running.broker.welcome_versions = (1, 2, 3, 4, 5)
        running.store.create_topic("t", 1)
        assert asyncio.run(run(running.urls[0])) == (5, 5, 1)


def test_an_aio_group_member_closed_as_messages_arrive_loses_none(home: Path) -> None:
    """A member's long polls are cancelled by close() (cancel_pull each) while a
    producer sends; what a cancelled pull's answer carried was never handed out nor
    committed, so the next member of the group gets every message, once or more."""
    rounds, per_round = 6, 50

    async def run(url: str) -> tuple[set[bytes], int]:
        async with await equeue.aio.connect(url) as client:
            handled: set[bytes] = set()
            sent = 0
            for round_number in range(rounds):
                member = client.consumer("g", "t", timeout=0.2)
                await member.start()
                for message in await member.poll_batch(timeout=0.05):
                    handled.add(message.body)
                bodies = [b"r%d-%d" % (round_number, i) for i in range(per_round)]
                sending = asyncio.ensure_future(client.send_batch("t", bodies))
                await asyncio.sleep(0)
                await member.close()  # its pulls cancelled as the batch lands
                await sending
                sent += per_round
            async with client.consumer("g", "t", timeout=1.0) as last:
                async for message in last:
                    handled.add(message.body)
            stats = await client.stats()
            assert stats["held_pulls"] == 0
            return handled, sent

    with BrokerThread(home / "s") as running:
        running.store.create_topic("t", 4)
        handled, sent = asyncio.run(run(running.urls[0]))
    expected = {b"r%d-%d" % (r, i) for r in range(rounds) for i in range(per_round)}
    assert sent == len(expected) and handled == expected


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def test_a_sync_long_poll_interrupted_is_cancelled(home: Path) -> None:
    """A KeyboardInterrupt (SIGALRM here) in a sync pull of a 600 s wait: the client
    sends cancel_pull, so the broker holds nothing afterwards, and the connection, which
    then reads both dropped answers, serves the next calls."""
    import signal

    import equeue

    with BrokerThread(home / "s") as running:
        running.store.create_topic("t", 1)
        with equeue.connect(running.urls[0]) as client, raw(running.urls[0]) as watcher:
            previous = signal.signal(signal.SIGALRM, _interrupt)
            try:
                for _ in range(3):
                    signal.setitimer(signal.ITIMER_REAL, 0.2)
                    with pytest.raises(KeyboardInterrupt):
                        client.pull("t", 0, 0, wait=LONG_S)
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    _held(watcher, 0)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            client.send("t", b"after", queue_id=0)
            assert [m.body for m in client.pull("t", 0, 0, wait=LONG_S).messages] == [b"after"]
            client.ping()  # (raises if the connection is out of step)


def test_a_second_pull_under_a_held_pulls_request_id_is_not_held(home: Path) -> None:
    """Ids in flight are unique (docs/protocol.md): a pull reusing a held pull's id is
    answered as not held (empty, at the next tick), so cancel_pull names one pull and
    the held pulls' bookkeeping stays whole."""
    with _a_pull_held(home) as (c, watcher, pull):
        c.send_raw(encode([pull, "pull", _pull()]))
        assert check_answer(c.recv(), "t") == (pull, 0, [[], 0])  # the second, not held
        assert watcher.call("stats")["held_pulls"] == 1
        cancel = c.request("cancel_pull", request_id=pull)
        assert c.answers(2) == {pull: (0, [[], 0]), cancel: (0, True)}
        _held(watcher, 0)


def test_a_sync_group_consumer_closed_cancels_its_held_pulls(home: Path) -> None:
    """A sync group consumer closed while its long polls are held: close sends
    cancel_pull for each, so once close returns the broker holds none (before, they
    were held until the leave's rebalance answered them at the broker's next tick,
    ~0.1-0.2 s later), and the client's next calls are served."""
    import equeue

    with BrokerThread(home / "s") as running:
        running.store.create_topic("t", 4)
        with equeue.connect(running.urls[0]) as client, raw(running.urls[0]) as watcher:
            for round_ in range(3):
                consumer = client.consumer("g", "t")
                assert consumer.poll(0.05) is None
                held = 0
                for _ in range(500):  # at most ~10 s: every queue's long poll held
                    held = watcher.call("stats")["held_pulls"]
                    if held >= 4:
                        break
                    time.sleep(0.02)
                assert held >= 4, held
                consumer.close()
                assert watcher.call("stats")["held_pulls"] == 0, round_
            client.send("t", b"after", queue_id=0)
            assert [m.body for m in client.pull("t", 0, 0).messages] == [b"after"]
            client.ping()
