"""``run(handler)`` without a timeout ends as iteration does: once nothing came for the
member's own ``timeout`` (reviewk F5: a member made with timeout=1.0 blocked in run for
ever while ``for message in consumer`` ended after 1 s)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from group_helpers import filled_broker_thread

import equeue
import equeue.aio
from equeue.store.types import Message

TOPIC = "one"
GUARD_SECONDS = 20.0  # a run that has not returned by then blocks (the old default)


@pytest.fixture
def url() -> Iterator[str]:
    with filled_broker_thread(TOPIC, 5) as url:
        yield url


def test_run_takes_the_member_s_timeout(url: str) -> None:
    handled: list[bytes] = []
    returned: list[int] = []
    with equeue.connect(url) as client:
        consumer = client.consumer("g", TOPIC, timeout=0.5)

        def handle(message: Message) -> None:
            handled.append(message.body)

        runner = threading.Thread(target=lambda: returned.append(consumer.run(handle)))
        runner.start()
        runner.join(GUARD_SECONDS)
        consumer.close()  # (releases a run still blocked)
        runner.join(GUARD_SECONDS)
    assert returned == [5], "run did not end after the member's timeout"
    assert handled == [b"m-%d" % i for i in range(5)]


def test_run_s_own_timeout_still_wins(url: str) -> None:
    with equeue.connect(url) as client, client.consumer("g", TOPIC) as consumer:
        assert consumer.run(lambda message: None, timeout=0.5) == 5


def test_asyncio_run_takes_the_member_s_timeout(url: str) -> None:
    async def main() -> int:
        client = await equeue.aio.connect(url)
        async with client.consumer("g", TOPIC, timeout=0.5) as consumer:
            handled = await asyncio.wait_for(consumer.run(lambda message: None), GUARD_SECONDS)
        await client.close()
        return handled

    assert asyncio.run(main()) == 5
