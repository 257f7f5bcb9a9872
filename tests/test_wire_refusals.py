"""What the broker refuses on the wire and how (review 37b): an op above the version a
connection was welcomed with, a nack's delay_ms past one day, committed_offset of names
commit_offset refuses, a pull offset past a uint64, a send_batch message naming a topic,
and a join_id that was never the consumer's. Each over a real Unix socket, against the
store's and both clients' answers where they have one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from server_helpers import Raw, raw, short_home

import equeue
import equeue.aio
from equeue.errors import EQueueError, InvalidMessageError
from equeue.protocol.frames import encode
from equeue.server import BrokerThread
from equeue.store.validate import MAX_DELAY_MS

home = pytest.fixture(short_home, name="home")


@pytest.fixture
def broker(home: Path) -> Iterator[BrokerThread]:
    with BrokerThread(home / "store") as running:
        yield running


def _stored(url: str, topic: str) -> int:
    with raw(url) as c:
        if topic not in c.call("topics"):
            return 0
        queue_ids = c.call("queue_ids", topic=topic)
        return sum(c.call("queue_range", topic=topic, queue_id=q)[1] for q in queue_ids)


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize(
    ("versions", "op", "args"),
    [
        ((1,), "send_bodies", {"topic": "t", "bodies": [b"a", b"b"]}),
        ((1,), "pull_columns", {"topic": "t", "queue_id": 0, "offset": 0}),
        ((1, 2), "pull_columns", {"topic": "t", "queue_id": 0, "offset": 0}),
    ],
)
def test_an_op_above_the_welcomed_version_closes_the_connection(
    broker: BrokerThread, versions: tuple[int, ...], op: str, args: dict[str, Any]
) -> None:
    url = broker.urls[0]
    with raw(url) as setup:
        setup.call("create_topic", topic="t", queue_count=1)
    with raw(url, versions=versions) as c, raw(url) as other:
        assert c.welcome["version"] == max(versions)
        c.send_raw(encode([1, op, args]))  # one frame a read: the C readers' path too
        error = c.closed_with()
        assert error["code"] == "ProtocolError", error
        assert f"op {op!r} is of protocol version" in error["message"], error
        assert f"welcomed with version {max(versions)}" in error["message"], error
        assert other.call("ping") is None  # that connection only
    assert _stored(url, "t") == 0


@pytest.mark.usefixtures("code_path")
def test_the_ops_of_the_welcomed_version_are_served(broker: BrokerThread) -> None:
    url = broker.urls[0]
    with raw(url) as setup:
        setup.call("create_topic", topic="t", queue_count=1)
    with raw(url, versions=(1, 2)) as c:
        assert c.welcome["version"] == 2
        columns = c.call("send_bodies", topic="t", bodies=[b"a", b"b"])
        assert columns[0] == "t" and columns[3] == [0, 1]
    with raw(url, versions=(3,)) as c:
        answer = c.call("pull_columns", topic="t", queue_id=0, offset=0)
        assert answer[0] == 2 and answer[9] == [b"a", b"b"]


def _member_with_a_message(c: Raw) -> tuple[int, str]:
    """Join g/a on topic t (one queue, one message): its join_id and the message's id."""
    c.call("create_topic", topic="t", queue_count=1)
    sent_id = c.call("send", topic="t", body=b"m")[0]
    join_id = c.call("join", group="g", consumer="a", topics=["t"])["join_id"]
    args = {"group": "g", "consumer": "a", "join_id": join_id}
    messages, _ = c.call("pull", topic="t", queue_id=0, offset=0, **args)
    assert [m[0] for m in messages] == [sent_id]
    return join_id, sent_id


def test_a_nack_delay_past_one_day_is_refused_and_parks_nothing(broker: BrokerThread) -> None:
    url = broker.urls[0]
    with raw(url) as c:
        join_id, message_id = _member_with_a_message(c)
        args = {"group": "g", "consumer": "a", "join_id": join_id, "message_id": message_id}
        error = c.error("nack", delay_ms=MAX_DELAY_MS + 1, **args)
        assert error["code"] == "InvalidMessageError", error
        assert f"delay_ms={MAX_DELAY_MS + 1} must lie in [0, {MAX_DELAY_MS}]" in error["message"]
        assert _stored(url, "equeue.delay") == 0  # nothing parked
        assert c.call("nack", delay_ms=MAX_DELAY_MS, **args) is None  # the bound itself
        assert _stored(url, "equeue.delay") == 1


@pytest.mark.parametrize("delay", [MAX_DELAY_MS / 1000 + 0.001, 1e12, -1.0, float("nan")])
def test_the_clients_refuse_a_nack_delay_past_one_day_before_sending(
    broker: BrokerThread, delay: float
) -> None:
    url = broker.urls[0]
    with equeue.connect(url) as client:
        client.create_topic("t", 1)
        client.send("t", b"m")
        with client.consumer("g", "t", timeout=5.0) as consumer:
            message = consumer.poll(timeout=5.0)
            assert message is not None
            errors = broker.broker.counters.errors
            with pytest.raises(InvalidMessageError, match=r"delay must be seconds in \[0, 86400\]"):
                consumer.nack(message, delay=delay)
            assert broker.broker.counters.errors == errors  # nothing reached the broker

    async def in_asyncio() -> None:
        async with await equeue.aio.connect(url) as client:
            consumer = client.consumer("h", "t", timeout=5.0)
            async with consumer:
                message = await consumer.poll(timeout=5.0)
                assert message is not None
                with pytest.raises(InvalidMessageError, match=r"must be seconds in \[0, 86400\]"):
                    await consumer.nack(message, delay=delay)

    asyncio.run(in_asyncio())
    assert _stored(url, "equeue.delay") == 0


NAME_CASES = [
    ("g", "nope", 0, "TopicNotFoundError"),
    ("", "nope", 0, "TopicNotFoundError"),  # the topic first, as commit_offset
    ("g", "t", 99, "QueueNotFoundError"),
    ("g", "t", -1, "QueueNotFoundError"),
    ("", "t", 0, "InvalidMessageError"),
    ("g" * 256, "t", 0, "InvalidMessageError"),
    ("g", "a/b", 0, "InvalidMessageError"),
]


def test_committed_offset_refuses_what_commit_offset_refuses(broker: BrokerThread) -> None:
    """A typo in a name reads as an error, not as "nothing committed" (None)."""
    url, store = broker.urls[0], broker.store
    store.create_topic("t", 2)

    def outcome(call: Any) -> tuple[str, str]:
        try:
            call()
        except EQueueError as exc:
            return type(exc).__name__, str(exc)
        raise AssertionError("accepted")

    async def in_asyncio() -> list[tuple[str, str]]:
        async with await equeue.aio.connect(url) as client:
            found = []
            for group, topic, queue_id, _ in NAME_CASES:
                try:
                    await client.committed_offset(group, topic, queue_id)
                except EQueueError as exc:
                    found.append((type(exc).__name__, str(exc)))
            return found

    with equeue.connect(url) as client, raw(url) as c:
        for group, topic, queue_id, code in NAME_CASES:
            committed = outcome(lambda: store.committed_offset(group, topic, queue_id))  # noqa: B023
            assert committed == outcome(lambda: store.commit_offset(group, topic, queue_id, 0))  # noqa: B023
            assert committed[0] == code, (group, topic, queue_id, committed)
            remote = outcome(lambda: client.committed_offset(group, topic, queue_id))  # noqa: B023
            assert remote[0] == code, (group, topic, queue_id, remote)
            assert remote == outcome(lambda: client.commit_offset(group, topic, queue_id, 0))  # noqa: B023
            if queue_id >= 0:  # (a negative queue_id is a wrong type on the wire)
                error = c.error("committed_offset", group=group, topic=topic, queue_id=queue_id)
                assert error["code"] == code, error
        assert [found[0] for found in asyncio.run(in_asyncio())] == [case[3] for case in NAME_CASES]
        assert client.committed_offset("g", "t", 1) is None  # nothing committed: still nil
        client.commit_offset("g", "t", 1, 0)
        assert client.committed_offset("g", "t", 1) == 0 == store.committed_offset("g", "t", 1)


def test_a_pull_past_a_uint64_reads_the_end_on_the_store_and_the_clients(
    broker: BrokerThread,
) -> None:
    """The store's pull takes any offset >= 0 (past the end: empty, at the end); the
    clients send one past the wire's uint64 as 2**64 - 1, with the same answer."""
    url, store = broker.urls[0], broker.store
    store.create_topic("t", 1)
    store.send("t", b"m")
    offsets = (2**64 - 1, 2**64, 2**70)

    async def in_asyncio() -> list[tuple[list[Any], int]]:
        async with await equeue.aio.connect(url) as client:
            return [((found := await client.pull("t", 0, at)).messages, found.next_offset)
                    for at in offsets]  # fmt: skip

    with equeue.connect(url) as client:
        for pull in (store.pull, client.pull):
            for at in offsets:
                found = pull("t", 0, at)
                assert (found.messages, found.next_offset) == ([], 1), (pull, at)
            with pytest.raises(InvalidMessageError, match="offset must be an int >= 0, got -1"):
                pull("t", 0, -1)
        for commit in (store.commit_offset, client.commit_offset):  # past the end alike
            with pytest.raises(InvalidMessageError, match="is past the queue's end"):
                commit("g", "t", 0, 2**64)
    assert asyncio.run(in_asyncio()) == [([], 1)] * len(offsets)


@pytest.mark.usefixtures("code_path")
def test_a_send_batch_message_with_a_topic_is_refused_naming_the_key(
    broker: BrokerThread,
) -> None:
    url = broker.urls[0]
    with raw(url) as c:
        c.request("send_batch", topic="t", messages=[{"body": b"a"}, {"body": b"b", "topic": "u"}])
        error = c.closed_with()
        assert error["code"] == "ProtocolError", error
        assert "message 1 has the key 'topic'" in error["message"], error
    with raw(url) as c:
        c.request("send_batch", topic="t", messages=[{"body": b"a"}, [b"b"]])
        error = c.closed_with()
        assert "message 1 is a list" in error["message"], error
    assert _stored(url, "t") == 0 and _stored(url, "u") == 0


def test_a_join_id_never_the_consumers_is_not_called_a_replaced_join(
    broker: BrokerThread,
) -> None:
    with raw(broker.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=2)
        first_a = c.call("join", group="g", consumer="A", topics=["t"])["join_id"]
        b = c.call("join", group="g", consumer="B", topics=["t"])["join_id"]
        error = c.error("heartbeat", group="g", consumer="A", join_id=b)
        assert error["code"] == "FencedMemberError", error
        assert f"join_id {b} is not consumer 'A' of group 'g''s" in error["message"], error
        assert "joined again" not in error["message"], error
        second_a = c.call("join", group="g", consumer="A", topics=["t"])["join_id"]
        error = c.error("leave", group="g", consumer="A", join_id=first_a)
        assert error["code"] == "FencedMemberError", error
        assert (
            f"joined again from another connection or process (join {second_a})"
            in (error["message"])
        )
        assert c.call("leave", group="g", consumer="A", join_id=second_a) is None


def test_a_plain_commit_offset_moves_the_offset_of_a_queue_a_member_holds(
    broker: BrokerThread,
) -> None:
    """As docs/protocol.md says: an operator's reset (no consumer) is not held to the
    assignment; a member's commit of a queue it does not hold is GroupError."""
    with raw(broker.urls[0]) as c:
        join_id, _ = _member_with_a_message(c)
        member = {"group": "g", "consumer": "a", "join_id": join_id}
        c.call("commit_offset", topic="t", queue_id=0, offset=1, **member)
        assert c.call("commit_offset", group="g", topic="t", queue_id=0, offset=0) is None
        assert c.call("committed_offset", group="g", topic="t", queue_id=0) == 0
        c.call("join", group="g", consumer="b", topics=["t"])  # one queue: b holds none
        error = c.error("commit_offset", group="g", consumer="b", topic="t", queue_id=0, offset=1)
        assert error["code"] == "GroupError", error
