"""The clients keep to the broker's ``max_in_flight``: a request takes a place until its
answer arrives (or the connection ends), and callers beyond the limit wait for a place
instead of being refused with LimitExceededError. Against the real broker (a child
process) with ``--max-in-flight 4``."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess

import equeue
import equeue.aio
from equeue import PullResult

PLACES = 4


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    try:
        with BrokerProcess(base / "store", "--max-in-flight", str(PLACES)) as running:
            yield running
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_cancelled_aio_long_poll_gives_its_place_back(broker: BrokerProcess) -> None:
    """Callers giving up on long polls (asyncio.wait_for) take their places back: the
    client sends cancel_pull (protocol version 6), the broker answers each pull at once,
    and the next requests go out without waiting for the pulls' 30 s (before, the pulls
    stayed held and the next request waited until a send answered them: reviewk F4;
    tests/test_cancel_pull.py has the version-5 fallback). The dropped answers leave the
    connection as it was."""

    async def main() -> None:
        async with await equeue.aio.connect(broker.url) as aio:
            await aio.create_topic("h", 1)
            for _ in range(PLACES):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(aio.pull("h", 0, 0, wait=30.0), 0.05)
            protocol = aio._protocol
            assert protocol is not None
            stats = await asyncio.wait_for(aio.stats(), 20)  # (30: the pulls' own end)
            assert stats["held_pulls"] == 0
            assert aio._protocol is protocol and not protocol.closed  # answers dropped
            with equeue.connect(broker.url) as other:
                other.send("h", b"wake")
            assert [m.body for m in await aio.pull("h", 0, 0)] == [b"wake"]
            await asyncio.wait_for(asyncio.gather(*(aio.ping() for _ in range(3 * PLACES))), 20)
            assert protocol.free == PLACES and not protocol.pending  # every place came back

    asyncio.run(main())


def test_sync_threads_beyond_max_in_flight_wait_for_a_place(broker: BrokerProcess) -> None:
    """3 x max_in_flight threads share one client, each in a long-poll pull: the broker
    holds max_in_flight of them, the others wait for a place (none is refused); one send
    from another client answers them all. Meanwhile two threads' send_many with a window
    of max_in_flight each (places taken by the held pulls too) complete."""
    with equeue.connect(broker.url) as client:
        client.create_topic("h", 1)
        client.create_topic("s", 2)
        results: list[Any] = []
        lock = threading.Lock()

        def run(job: Any) -> None:
            try:
                outcome = job()
            except BaseException as exc:  # (the test reports it)
                outcome = exc
            with lock:
                results.append(outcome)

        pulls = [
            threading.Thread(target=run, args=(lambda: client.pull("h", 0, 0, wait=30.0),))
            for _ in range(3 * PLACES)
        ]
        for thread in pulls:
            thread.start()
        time.sleep(0.5)  # (the refused ones, before the fix, come back at once)
        assert not results, results  # nobody was refused; all wait
        with equeue.connect(broker.url) as other:
            other.send("h", b"wake")
        for thread in pulls:
            thread.join(30)
        assert not any(thread.is_alive() for thread in pulls)
        assert all(isinstance(r, PullResult) for r in results), results
        assert [[m.body for m in r] for r in results] == [[b"wake"]] * (3 * PLACES)

        results.clear()
        senders = [
            threading.Thread(
                target=run,
                args=(lambda n=n: client.send_many("s", [b"%d" % n] * 300, window=PLACES),),
            )
            for n in range(2)
        ]
        held = threading.Thread(target=run, args=(lambda: client.pull("h", 0, 1, wait=1.0),))
        held.start()
        for thread in senders:
            thread.start()
        for thread in [*senders, held]:
            thread.join(60)
        assert not any(thread.is_alive() for thread in [*senders, held])
        assert sorted(len(r) for r in results) == [0, 300, 300], results
        assert sum(hi - lo for q in (0, 1) for lo, hi in [client.queue_range("s", q)]) == 600
