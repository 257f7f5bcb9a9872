"""A group member (sync and asyncio) made before a fork is closed in the child: its
calls raise ClosedError naming the fork, its close() neither commits nor leaves, and the
parent's membership goes on untouched (reviewk F2: both processes pulled as the one
member and every message was handled twice, four times with three children)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections import Counter
from collections.abc import Iterator

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.sync import Client
from equeue.errors import ClosedError

MESSAGES = 400
BEFORE_FORK = 100  # handled by the parent before it forks: the member works (control)


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


def _fill(url: str) -> Client:
    client = equeue.connect(url)
    client.create_topic("t", queue_count=2)
    for i in range(MESSAGES):
        client.send("t", b"m-%d" % i)
    return client


def _committed(client: Client) -> int:
    return sum(client.committed_offset("g", "t", q) or 0 for q in range(2))


def _child_refuses(attempt: object) -> int:
    """In the child: 0 if ``attempt()`` raised ClosedError naming the fork, 1 if it gave
    anything (a message, None), 2 if it raised something else."""
    try:
        attempt()  # type: ignore[operator]
    except ClosedError as exc:
        return 0 if "before this process forked" in str(exc) else 2
    except BaseException:
        return 2
    return 1


def test_a_member_made_before_os_fork_is_closed_in_the_child(broker: BrokerProcess) -> None:
    client = _fill(broker.url)
    consumer = client.consumer("g", "t", timeout=2.0)
    seen: Counter[bytes] = Counter()
    for message in consumer:  # the control: this member consumes
        seen[message.body] += 1
        if sum(seen.values()) == BEFORE_FORK:
            break
    join_id = consumer.state.join_id
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            signal.alarm(30)
            code = _child_refuses(lambda: next(iter(consumer)))
            code = code or _child_refuses(lambda: consumer.poll(1.0))
            code = code or _child_refuses(consumer.commit)
            consumer.close()  # (nothing: neither a commit nor a leave for the parent)
            with consumer:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's member was not refused"
    for message in consumer:  # the rest, in the same membership
        seen[message.body] += 1
    assert consumer.state.join_id == join_id, "the child left or fenced the parent's member"
    consumer.close()
    assert len(seen) == MESSAGES and max(seen.values()) == 1
    assert _committed(client) == MESSAGES
    client.close()


_pooled: GroupConsumer | None = None


def _poll_in_worker(_: int) -> str:
    assert _pooled is not None
    try:
        message = _pooled.poll(1.0)
    except ClosedError as exc:
        return str(exc)
    return f"handed {message!r}"


def test_a_member_made_before_a_fork_pool_is_closed_in_its_workers(
    broker: BrokerProcess,
) -> None:
    global _pooled
    client = _fill(broker.url)
    _pooled = consumer = client.consumer("g", "t", timeout=2.0)
    try:
        first = consumer.poll(5.0)
        assert first is not None  # the control
        with multiprocessing.get_context("fork").Pool(2) as pool:
            answers = pool.map(_poll_in_worker, range(4), chunksize=1)
        assert all("before this process forked" in a for a in answers), answers
        handled = 1 + sum(1 for _ in consumer)
        assert handled == MESSAGES
        consumer.close()
        assert _committed(client) == MESSAGES
    finally:
        _pooled = None
        client.close()


async def _drain(consumer: AsyncGroupConsumer, seen: Counter[bytes]) -> None:
    async for message in consumer:
        seen[message.body] += 1


def test_an_asyncio_member_made_before_a_fork_is_closed_in_the_child(
    broker: BrokerProcess,
) -> None:
    checker = _fill(broker.url)
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(equeue.aio.connect(broker.url))
        consumer = client.consumer("g", "t", timeout=2.0)
        seen: Counter[bytes] = Counter()
        for _ in range(BEFORE_FORK):  # the control
            message = loop.run_until_complete(consumer.poll(5.0))
            assert message is not None
            seen[message.body] += 1
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                signal.alarm(30)
                code = _child_refuses(lambda: loop.run_until_complete(consumer.poll(1.0)))
                loop.run_until_complete(consumer.close())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child's member was not refused"
        loop.run_until_complete(_drain(consumer, seen))
        loop.run_until_complete(consumer.close())
        assert len(seen) == MESSAGES and max(seen.values()) == 1
        assert _committed(checker) == MESSAGES
        loop.run_until_complete(client.close())
    finally:
        loop.close()
        checker.close()
