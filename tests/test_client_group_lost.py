"""A member that learns its membership is gone hands out nothing it fetched for it: it
joins again first, in the same poll (both loops). review19 R19-8: a refused commit, or a
caller back after max_poll_interval (the heartbeat stopped meanwhile, the session
expired and another member handled the queue), and the loop still handed out its
prefetched messages, duplicates it could have avoided."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from group_helpers import broker_thread

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.sync import Client

TOPIC = "one"
COUNT = 20


@pytest.fixture
def url() -> Iterator[str]:
    with broker_thread(TOPIC, 1) as url:
        with equeue.connect(url) as client:
            for i in range(COUNT):
                client.send(TOPIC, b"m-%d" % i)
        yield url


def test_a_commit_refused_in_a_poll_hands_out_nothing_of_the_old_buffer(url: str) -> None:
    # a 30 s session: the heartbeat thread (every 10 s) does not learn it first
    with (
        equeue.connect(url) as client,
        client.consumer(
            "g", TOPIC, batch_size=8, auto_commit_interval=0.0, session_timeout=30.0
        ) as member,
    ):
        offsets = [_offset(member.poll(5.0)) for _ in range(3)]
        assert offsets == [0, 1, 2]
        assert member.state.held() > 0  # the rest of its batch is buffered
        committed = client.committed_offset("g", TOPIC, 0)
        client.request("leave", member.state.member_args())  # its membership ends
        # this poll's commit of m-2 is refused: it joins again and starts where the
        # group committed (before: it handed out m-3 from the lost membership's buffer)
        assert _offset(member.poll(5.0)) == committed == 2


def test_an_asyncio_commit_refused_in_a_poll_hands_out_nothing_of_the_old_buffer(
    url: str,
) -> None:
    async def consume() -> tuple[list[int], int | None, int]:
        client = await equeue.aio.connect(url)
        member = AsyncGroupConsumer(
            client, "g", TOPIC, batch_size=8, auto_commit_interval=0.0, session_timeout=30.0
        )
        async with member:
            offsets = [_offset(await member.poll(5.0)) for _ in range(3)]
            committed = await client.committed_offset("g", TOPIC, 0)
            await client.request("leave", member.state.member_args())
            after = _offset(await member.poll(5.0))
        await client.close()
        return offsets, committed, after

    offsets, committed, after = asyncio.run(consume())
    assert offsets == [0, 1, 2]
    assert after == committed == 2


def test_a_caller_back_after_max_poll_interval_asks_before_handing_out(url: str) -> None:
    # a's caller is away (a slow handler) past max_poll_interval: a stops heartbeating,
    # expires, and b, joining after that, handles and commits the whole queue. At a's
    # next poll no assignment is new, no commit is due (auto_commit_interval) and its
    # queue has no pull in flight (prefetch=1: m-3 is at hand): no refusal tells it,
    # only its own question
    with equeue.connect(url) as client:
        a = client.consumer(
            "g", TOPIC, consumer_id="a", batch_size=4, prefetch=1, session_timeout=1.0,
            max_poll_interval=0.5, auto_commit_interval=60.0,
        )  # fmt: skip
        with a:
            assert [_offset(a.poll(5.0)) for _ in range(3)] == [0, 1, 2]
            assert a.state.held() > 0
            with equeue.connect(url) as other:
                while "a" in _members(other.stats("g")):
                    time.sleep(0.05)  # (bounded: a expires within about 1.5 s)
                _drain_as_b(other)
            # back from the handler: nothing of the old buffer (before: m-3, m-4, ...
            # which b handled), the member joins again and finds the queue committed
            assert _handed_out(a) == []
            assert client.committed_offset("g", TOPIC, 0) == COUNT


def test_an_asyncio_caller_back_after_max_poll_interval_asks_before_handing_out(
    url: str,
) -> None:
    async def consume() -> list[int]:
        client = await equeue.aio.connect(url)
        a = AsyncGroupConsumer(
            client, "g", TOPIC, consumer_id="a", batch_size=4, prefetch=1, session_timeout=1.0,
            max_poll_interval=0.5, auto_commit_interval=60.0,
        )  # fmt: skip
        async with a:
            assert [_offset(await a.poll(5.0)) for _ in range(3)] == [0, 1, 2]
            assert a.state.held() > 0
            # the handler awaits b's work: the heartbeat task runs and stops beating
            other = await equeue.aio.connect(url)
            while "a" in _members(await other.stats("g")):
                await asyncio.sleep(0.05)  # (bounded: a expires within about 1.5 s)
            b = AsyncGroupConsumer(other, "g", TOPIC, consumer_id="b", session_timeout=1.0)
            async with b:
                deadline = time.monotonic() + 30
                while await other.committed_offset("g", TOPIC, 0) != COUNT:
                    assert time.monotonic() < deadline, "b never took and finished the queue"
                    await b.poll(0.2)
            await other.close()
            after = []
            for _ in range(COUNT):
                message = await a.poll(2.0)
                if message is None:
                    break
                after.append(message.queue_offset)
        await client.close()
        return after

    assert asyncio.run(consume()) == []


def _drain_as_b(client: Client) -> None:
    """Member b joins, gets the queue once a expired, handles and commits all of it, and
    leaves: bounded by a deadline."""
    with client.consumer("g", TOPIC, consumer_id="b", session_timeout=1.0) as b:
        deadline = time.monotonic() + 30
        while client.committed_offset("g", TOPIC, 0) != COUNT:
            assert time.monotonic() < deadline, "b never took and finished the queue"
            b.poll(0.2)


def _members(stats: dict[str, Any]) -> dict[str, Any]:
    detail = stats.get("coordinator", {}).get("g")  # (a group with members)
    return detail["members"] if detail else {}


def _handed_out(member: GroupConsumer) -> list[int]:
    offsets = []
    for _ in range(COUNT):
        message = member.poll(2.0)
        if message is None:
            break
        offsets.append(message.queue_offset)
    return offsets


def _offset(message: equeue.Message | None) -> int:
    assert message is not None
    return message.queue_offset


def test_a_caller_back_late_whose_session_lives_goes_on_with_its_buffer(url: str) -> None:
    # the question costs a heartbeat, not the membership: a 6 s session outlives the
    # caller's absence (a skipped beat at most 2 s after the last one)
    with (
        equeue.connect(url) as client,
        client.consumer(
            "g", TOPIC, batch_size=4, prefetch=1, session_timeout=6.0, max_poll_interval=0.2
        ) as member,
    ):
        assert [_offset(member.poll(5.0)) for _ in range(3)] == [0, 1, 2]
        join_id = member.state.join_id
        deadline = time.monotonic() + 30
        while not member._lapsed:  # the heartbeat thread skipped a beat
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [_offset(member.poll(5.0)) for _ in range(2)] == [3, 4]
        assert member.state.join_id == join_id and not member._lapsed


def test_an_asyncio_caller_back_late_whose_session_lives_goes_on_with_its_buffer(
    url: str,
) -> None:
    async def consume() -> None:
        client = await equeue.aio.connect(url)
        member = AsyncGroupConsumer(
            client, "g", TOPIC, batch_size=4, prefetch=1, session_timeout=6.0,
            max_poll_interval=0.2,
        )  # fmt: skip
        async with member:
            assert [_offset(await member.poll(5.0)) for _ in range(3)] == [0, 1, 2]
            join_id = member.state.join_id
            deadline = time.monotonic() + 30
            while not member._lapsed:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert [_offset(await member.poll(5.0)) for _ in range(2)] == [3, 4]
            assert member.state.join_id == join_id and not member._lapsed
        await client.close()

    asyncio.run(consume())
