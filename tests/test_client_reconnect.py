"""The clients when the broker is SIGKILLed and started again (a real child process):
the next call reconnects; a send in flight at the kill is reported in ``unanswered``,
never sent again, so the store holds each message at most once and every acknowledged
one (``--flush sync``)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess, send_many_killed

import equeue
import equeue.aio
from equeue.client import Client
from equeue.errors import ConnectionLostError


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stored_bodies(client: Client, topic: str) -> Counter[bytes]:
    found: Counter[bytes] = Counter()
    for queue_id in client.queue_ids(topic):
        offset = 0
        while batch := client.pull(topic, queue_id, offset, max_count=1000):
            found.update(m.body for m in batch)
            offset = batch.next_offset
    return found


def test_the_next_call_after_a_restart_reconnects(base: Path) -> None:
    with BrokerProcess(base / "store") as broker:
        client = equeue.connect(broker.url, connect_timeout=10)
        first = client.send("t", b"before")
        broker.kill()
        broker.start()
        second = client.send("t", b"after")  # no error: the dead connection is replaced
        assert client.get(first.message_id).body == b"before"
        assert client.get(second.message_id).body == b"after"

        async def with_aio() -> None:
            aio = await equeue.aio.connect(broker.url, connect_timeout=10)
            await aio.send("t", b"aio before")
            broker.kill()
            broker.start()
            result = await aio.send("t", b"aio after")
            assert (await aio.get(result.message_id)).body == b"aio after"
            await aio.close()

        asyncio.run(with_aio())
        broker.kill()
        started = time.monotonic()
        with pytest.raises(ConnectionLostError, match=broker.url) as raised:
            equeue.connect(broker.url, connect_timeout=0.5)
        assert "connect_timeout=0.5s" in str(raised.value)
        assert time.monotonic() - started < 10
        client.connect_timeout = 0.5
        with pytest.raises(ConnectionLostError, match="connect_timeout"):
            client.ping()
        client.close()


def test_sends_in_flight_at_a_kill_are_unanswered_and_never_sent_twice(base: Path) -> None:
    bodies = [f"k{i}".encode() for i in range(400_000)]
    with BrokerProcess(base / "store", "--flush", "sync") as broker:
        client = equeue.connect(broker.url, connect_timeout=10)
        client.create_topic("k", 2)
        error = send_many_killed(broker, client, "k", bodies, 256, 2000)
        unanswered, unsent = error.unanswered, error.unsent
        assert unanswered, "a send was in flight at the kill"
        assert len(error.sent) + len(unanswered) + len(unsent) == len(bodies)
        acknowledged = set(bodies[: len(error.sent)])  # one connection: answered in order
        assert [r.queue_offset for r in error.sent if r.queue_id == 0] == list(
            range(len([r for r in error.sent if r.queue_id == 0]))
        )
        broker.start()
        stored = stored_bodies(client, "k")  # the next call reconnects
        assert max(stored.values()) == 1  # nothing stored twice
        assert acknowledged <= set(stored)  # every acknowledged send survived the kill
        assert set(stored) <= acknowledged | set(unanswered)
        assert not set(unsent) & set(stored)
        client.close()


def test_aio_sends_in_flight_at_a_kill_are_each_reported_to_their_caller(base: Path) -> None:
    with BrokerProcess(base / "store", "--flush", "sync") as broker:
        acknowledged: list[bytes] = []
        unanswered: list[Any] = []

        async def main() -> None:
            client = await equeue.aio.connect(broker.url, connect_timeout=10)
            stop = asyncio.Event()

            async def producer(n: int) -> None:
                for i in range(100_000):
                    if stop.is_set():
                        return
                    body = f"{n}:{i}".encode()
                    try:
                        await client.send("a", body)
                    except ConnectionLostError as exc:
                        unanswered.extend(exc.unanswered)
                        stop.set()
                        return
                    acknowledged.append(body)

            producers = [asyncio.ensure_future(producer(n)) for n in range(300)]
            while len(acknowledged) < 3000:
                await asyncio.sleep(0.01)
            broker.kill()
            await asyncio.wait_for(asyncio.gather(*producers), 60)
            broker.start()
            await client.close()

        asyncio.run(main())
        assert unanswered and all(isinstance(m, equeue.OutgoingMessage) for m in unanswered)
        bodies = [m.body for m in unanswered]
        assert len(set(bodies)) == len(bodies) and not set(bodies) & set(acknowledged)
        with equeue.connect(broker.url) as client:
            stored = stored_bodies(client, "a")
        assert max(stored.values()) == 1
        assert set(acknowledged) <= set(stored)
        assert set(stored) <= set(acknowledged) | set(bodies)
