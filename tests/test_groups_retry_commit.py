"""A retry queue is committed at its own offsets, not at its copies' original ones (review
30a, finding 1): the copies are handed out restored to their original topic, queue and
offset, and a batch of them processed in part (commit, close, auto-commit, a revoked
queue) must commit the retry queue after the last copy processed. Through a real broker
(BrokerThread on a Unix socket) for both consumers, and ``Batch`` alone."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import test_groups_fixes
from test_groups_broker import consume

import equeue
import equeue.aio
from equeue.client.consumer import GroupConsumer
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.client.groupstate import Batch, GroupState
from equeue.protocol import pullcols
from equeue.protocol.retries import (
    ATTEMPT,
    GROUP,
    ORIGIN_OFFSET,
    ORIGIN_QUEUE,
    ORIGIN_TOPIC,
    dead_letter_topic,
    retry_topic,
)
from equeue.store.types import Message

url = test_groups_fixes.url  # the fixture: a broker's URL, its topic "one" of 1 queue
TOPIC = test_groups_fixes.TOPIC
SENT = 20
LONG = 3600.0  # no auto-commit of its own: the test's commit() is the mid-batch one
# the original offsets of the nacked messages: below the retry queue's end (a wrong
# commit lands silently on another copy) and past it (the broker refuses it)
NACKED = {"low": range(1, 6), "high": range(15, 20)}


@pytest.mark.parametrize("where", sorted(NACKED))
def test_a_mid_batch_commit_of_retry_copies_loses_none(url: str, where: str) -> None:
    nacked = NACKED[where]
    with equeue.connect(url) as client:
        client.send_batch(TOPIC, [b"m%d" % i for i in range(SENT)])
        first = GroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG, max_retries=1)
        try:
            for message in consume(first, SENT, 10.0):
                if message.topic == TOPIC and message.queue_offset in nacked:
                    first.nack(message, delay=0)  # copies at retry offsets 0..4
        finally:
            first.close()
        assert client.queue_range(retry_topic("g"), 0) == (0, len(nacked))

        # every copy is stored before this member joins: one pull, one batch of 5
        second = GroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG, max_retries=1)
        try:
            kept, again = consume(second, 2, 10.0)
            # handed out at their original places
            assert (kept.topic, kept.queue_id, kept.queue_offset) == (TOPIC, 0, nacked[0])
            assert (again.topic, again.queue_offset) == (TOPIC, nacked[1])
            second.nack(again)  # its second attempt: past max_retries, dead-lettered
            second.commit()  # 2 of the batch's 5 processed
            assert client.committed_offset("g", retry_topic("g"), 0) == 2
        finally:
            second.close()
        assert client.committed_offset("g", retry_topic("g"), 0) == 2

        with GroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG) as third:
            rest = consume(third, len(nacked) - 2, 10.0)
            assert third.poll(0.3) is None
        assert sorted(m.body for m in rest) == sorted(b"m%d" % i for i in nacked[2:])
        assert client.committed_offset("g", retry_topic("g"), 0) == len(nacked)
        (dead,) = client.pull(dead_letter_topic("g"), 0, 0).messages
        assert dead.body == b"m%d" % nacked[1] and dead.properties[ATTEMPT] == "2"
        assert dead.properties[ORIGIN_OFFSET] == str(nacked[1])


@pytest.mark.parametrize("where", sorted(NACKED))
def test_a_mid_batch_commit_of_retry_copies_loses_none_asyncio(url: str, where: str) -> None:
    nacked = NACKED[where]

    async def collect(consumer: AsyncGroupConsumer, count: int) -> list[equeue.Message]:
        got: list[equeue.Message] = []
        deadline = time.monotonic() + 10.0
        while len(got) < count and time.monotonic() < deadline:
            message = await consumer.poll(0.5)
            if message is not None:
                got.append(message)
        return got

    async def main() -> None:
        client = await equeue.aio.connect(url)
        try:
            await client.send_batch(TOPIC, [b"m%d" % i for i in range(SENT)])
            async with AsyncGroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG) as c:
                for message in await collect(c, SENT):
                    if message.queue_offset in nacked:
                        await c.nack(message, delay=0)
            assert await client.queue_range(retry_topic("g"), 0) == (0, len(nacked))

            second = AsyncGroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG)
            async with second:
                kept, again = await collect(second, 2)
                assert (kept.topic, kept.queue_offset) == (TOPIC, nacked[0])
                assert (again.topic, again.queue_offset) == (TOPIC, nacked[1])
                # ``again`` is in hand: close() counts it processed and commits both
            assert await client.committed_offset("g", retry_topic("g"), 0) == 2

            async with AsyncGroupConsumer(client, "g", TOPIC, auto_commit_interval=LONG) as c:
                rest = await collect(c, len(nacked) - 2)
                assert await c.poll(0.3) is None
            assert sorted(m.body for m in rest) == sorted(b"m%d" % i for i in nacked[2:])
        finally:
            await client.close()

    asyncio.run(main())


def _copies(group: str, origins: list[int]) -> list[object]:
    """Retry copies at retry offsets 0.. of messages at ``origins`` in queue 2 of 'orders',
    as the broker packs them (pull_columns) and the member unpacks them."""
    prefix, topic = "0000abcd", retry_topic(group)
    messages = []
    for at, o in enumerate(origins):
        props = {ORIGIN_TOPIC: "orders", ORIGIN_QUEUE: "2", ORIGIN_OFFSET: str(o), GROUP: group}
        messages.append(
            Message(f"{prefix}{at:016x}", topic, 0, at, 100 + at, "", None, props, 0, b"x", 1, 1)
        )
    data, kept = pullcols._pack(messages, len(messages), topic, 0, prefix, 1 << 20)
    assert data is not None and kept == len(messages)
    answer: list[object] = msgpack.unpackb(data)
    return answer


@pytest.mark.parametrize("origins", [[5000, 5001, 5002], [7, 3, 9], [0, 1, 2]])
def test_group_state_commits_a_retry_queue_at_its_own_offsets(origins: list[int]) -> None:
    key = (retry_topic("g"), 0)
    state = GroupState(
        "test", "g", ["orders"], tags=None, batch_size=32, auto_commit=True,
        auto_commit_interval=1.0, session_timeout=10, max_poll_interval=300,
        max_retries=None, consumer_id="c",
    )  # fmt: skip
    state.lost = False
    state.add(key, None, [0, 3])
    assert state.pulled(key, 0, _copies("g", origins)) == 3
    message = state.next_message()
    assert (message.topic, message.queue_id, message.queue_offset) == ("orders", 2, origins[0])
    assert state.to_commit() == {key: 0}  # handed out, not processed yet
    state.done_with_pending()
    assert state.to_commit() == {key: 1}
    state.next_message()
    state.done_with_pending()
    assert state.to_commit() == {key: 2}
    state.next_message()
    state.done_with_pending()
    assert state.to_commit() == {key: 3}


def test_batch_after_uses_the_queues_own_offsets() -> None:
    restored = [
        Message("id", "orders", 2, o, 0, "", None, {}, 0, b"", 1, 1) for o in (5000, 5001, 5002)
    ]
    batch = Batch(restored, (retry_topic("g"), 0), 13, [10, 11, 12])
    assert batch.after() == 10  # none processed: the first copy's own offset
    batch.done = 1
    assert batch.after() == 11
    batch.done = 2
    assert batch.after() == 12
    batch.done = 3
    assert batch.after() == 13  # whole: where the next pull starts
    plain = Batch(restored, ("orders", 2), 5003)
    plain.done = 2
    assert plain.after() == 5002  # an ordinary queue: its messages' own offsets
