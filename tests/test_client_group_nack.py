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
