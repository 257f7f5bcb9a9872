"""A group member's close() outside ``with`` leaves the message in hand uncommitted when
its handler failed: called while an exception is handled (``try: ... finally:
close()``), or (asyncio) after the task it was handed to was cancelled or raised
(reviewk F3: the failed 6th, the cancelled 7th, were committed and never delivered
again). A loop left normally still counts the message in hand as processed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from group_helpers import filled_broker_thread

import equeue
import equeue.aio
from equeue.client.consumer_aio import AsyncGroupConsumer

TOPIC = "one"


class HandlerFailed(Exception):
    pass


@pytest.fixture
def url() -> Iterator[str]:
    with filled_broker_thread(TOPIC, 20) as url:
        yield url


def _committed(url: str, group: str) -> int | None:
    with equeue.connect(url) as client:
        return client.committed_offset(group, TOPIC, 0)


def test_close_after_a_loop_left_normally_commits_the_message_in_hand(url: str) -> None:
    with equeue.connect(url) as client:
        consumer = client.consumer("g", TOPIC, auto_commit_interval=60.0)
        try:
            for handled, _ in enumerate(consumer, 1):
                if handled == 5:
                    break
        finally:
            consumer.close()
    assert _committed(url, "g") == 5


def test_close_in_finally_after_the_handler_raised_leaves_its_message(url: str) -> None:
    with equeue.connect(url) as client:
        consumer = client.consumer("g", TOPIC, auto_commit_interval=60.0)
        with pytest.raises(HandlerFailed):
            try:
                for handled, _ in enumerate(consumer, 1):
                    if handled == 6:
                        raise HandlerFailed
            finally:
                consumer.close()
    assert _committed(url, "g") == 5  # the 6th comes again


def test_close_processed_false_leaves_the_message_in_hand(url: str) -> None:
    with equeue.connect(url) as client:
        consumer = client.consumer("g", TOPIC, auto_commit_interval=60.0)
        for handled, _ in enumerate(consumer, 1):
            if handled == 4:
                break
        consumer.close(processed=False)
    assert _committed(url, "g") == 3


async def _consume(
    consumer: AsyncGroupConsumer, stop_at: int, how: str, reached: asyncio.Event
) -> None:
    handled = 0
    async for _ in consumer:
        handled += 1
        if handled == stop_at:
            reached.set()
            if how == "raise":
                raise HandlerFailed
            if how == "hang":
                await asyncio.sleep(60)  # (cancelled)
            return


@pytest.mark.parametrize(("how", "committed"), [("return", 7), ("raise", 6), ("hang", 6)])
def test_asyncio_close_after_the_consuming_task_ended(url: str, how: str, committed: int) -> None:
    async def main() -> None:
        client = await equeue.aio.connect(url)
        consumer = await client.consumer("g", TOPIC, auto_commit_interval=60.0).start()
        reached = asyncio.Event()
        task = asyncio.create_task(_consume(consumer, 7, how, reached))
        await asyncio.wait_for(reached.wait(), 10)
        task.cancel()  # the application shuts down: cancels its worker, then closes
        with contextlib.suppress(HandlerFailed, asyncio.CancelledError):
            await task
        await consumer.close()
        await client.close()

    asyncio.run(main())
    assert _committed(url, "g") == committed
