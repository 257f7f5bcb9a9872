"""A group member's nack (both loops): a wrong argument raises an equeue error before
anything is sent, and a nack the broker refuses before copying anything raises without
resetting the membership, so what was handled is not handed out again (reviewk F6: a
builtin AttributeError for nack("abc"), and m-0..m-4 redelivered after a refused nack)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from group_helpers import broker_thread

import equeue
import equeue.aio
from equeue.errors import InvalidMessageError, InvalidTypeError, MessageNotFoundError
from equeue.protocol.retries import retry_topic

TOPIC = "one"
UNKNOWN_ID = "00" * 12


@pytest.fixture
def url() -> Iterator[str]:
    with broker_thread(TOPIC, 1) as url:
        yield url


def _fill(url: str, count: int) -> None:
    with equeue.connect(url) as client:
        for i in range(count):
            client.send(TOPIC, b"m-%d" % i)


def test_a_wrong_nack_argument_raises_an_equeue_error_and_sends_nothing(url: str) -> None:
    _fill(url, 3)
    with equeue.connect(url) as client, client.consumer("g", TOPIC) as consumer:
        message = consumer.poll(5.0)
        assert message is not None
        with pytest.raises(InvalidTypeError, match="nack takes a Message"):
            consumer.nack("abc")  # type: ignore[arg-type]
        for delay in ("1", True):
            with pytest.raises(InvalidTypeError, match="delay must be seconds"):
                consumer.nack(message, delay=delay)  # type: ignore[arg-type]
        with pytest.raises(InvalidMessageError, match="delay must be seconds in"):
            consumer.nack(message, delay=-1)
        assert client.queue_range(retry_topic("g"), 0) == (0, 0)  # nothing copied


def test_a_refused_nack_raises_and_keeps_the_membership(url: str) -> None:
    _fill(url, 10)
    with (
        equeue.connect(url) as client,
        client.consumer("g", TOPIC, auto_commit_interval=60.0) as consumer,
    ):
        handled = []
        for _ in range(6):
            message = consumer.poll(5.0)
            assert message is not None
            handled.append(message.body)
        join_id = consumer.state.join_id
        assert message is not None
        with pytest.raises(MessageNotFoundError):
            consumer.nack(message._replace(message_id=UNKNOWN_ID))
        while (more := consumer.poll(1.0)) is not None:
            handled.append(more.body)
        assert handled == [b"m-%d" % i for i in range(10)]  # none handed out again
        assert consumer.state.join_id == join_id


def test_an_asyncio_member_s_refused_nack_raises_and_keeps_the_membership(url: str) -> None:
    _fill(url, 10)

    async def consume() -> list[bytes]:
        client = await equeue.aio.connect(url)
        handled = []
        async with client.consumer("g", TOPIC, auto_commit_interval=60.0) as consumer:
            for _ in range(6):
                message = await consumer.poll(5.0)
                assert message is not None
                handled.append(message.body)
            with pytest.raises(InvalidTypeError, match="nack takes a Message"):
                await consumer.nack(b"m-5")  # type: ignore[arg-type]
            assert message is not None
            with pytest.raises(MessageNotFoundError):
                await consumer.nack(message._replace(message_id=UNKNOWN_ID))
            while (more := await consumer.poll(1.0)) is not None:
                handled.append(more.body)
        await client.close()
        return handled

    assert asyncio.run(consume()) == [b"m-%d" % i for i in range(10)]


def test_a_nack_of_a_message_of_another_topic_is_refused_before_sending(url: str) -> None:
    # review19 R19-7: the broker refused it ("does not hold other/0"), taken as a nack in
    # doubt: the membership was reset and m-0..m-3 handed out again, nothing raised
    _fill(url, 6)
    with equeue.connect(url) as client:
        client.create_topic("other", 1)
        client.send("other", b"foreign")
        foreign = client.pull("other", 0, 0, 1).messages[0]
        with client.consumer("g", TOPIC, auto_commit_interval=60.0) as consumer:
            handled = [_body(consumer.poll(5.0)) for _ in range(4)]
            join_id = consumer.state.join_id
            with pytest.raises(InvalidMessageError, match=r"other/0 at offset 0\) is of a topic"):
                consumer.nack(foreign)
            while (more := consumer.poll(1.0)) is not None:
                handled.append(more.body)
            assert handled == [b"m-%d" % i for i in range(6)]  # none handed out again
            assert consumer.state.join_id == join_id
        assert client.queue_range(retry_topic("g"), 0) == (0, 0)  # nothing copied


def test_an_asyncio_nack_of_another_group_s_retry_copy_is_refused(url: str) -> None:
    _fill(url, 6)

    async def consume() -> tuple[list[bytes], int | None, int | None]:
        client = await equeue.aio.connect(url)
        # group h's retry copy of m-0, read by a plain pull of h's retry topic
        async with client.consumer("h", TOPIC) as other:
            first = await other.poll(5.0)
            assert first is not None
            await other.nack(first, delay=0)
        while (await client.queue_range(retry_topic("h"), 0))[1] == 0:
            await asyncio.sleep(0.05)  # (the mover's next tick: 100 ms)
        copy = (await client.pull(retry_topic("h"), 0, 0, 1)).messages[0]
        async with client.consumer("g", TOPIC, auto_commit_interval=60.0) as consumer:
            handled = [_body(await consumer.poll(5.0)) for _ in range(4)]
            join_id = consumer.state.join_id
            with pytest.raises(InvalidMessageError, match="is of a topic group 'g' does not"):
                await consumer.nack(copy)
            while (more := await consumer.poll(1.0)) is not None:
                handled.append(more.body)
            same = consumer.state.join_id == join_id
        await client.close()
        return handled, join_id if same else None, join_id

    handled, kept, join_id = asyncio.run(consume())
    assert handled == [b"m-%d" % i for i in range(6)]
    assert kept == join_id


def _body(message: equeue.Message | None) -> bytes:
    assert message is not None
    return message.body
