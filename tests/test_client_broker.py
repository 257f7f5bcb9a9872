"""The clients against the real broker (``equeue serve`` in a child process): the same
calls on a client and on an in-process MessageStore give the same results and the same
error classes; pipelined answers reach the right callers; a read-only handle in another
process sees what the clients sent."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess

import equeue
import equeue.aio
from equeue import Message, MessageStore, OutgoingMessage, PullResult, SendResult, StoreConfig
from equeue.errors import EQueueError
from equeue.protocol.frames import PROTOCOL_VERSION

Op = Callable[[Any], Any]


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def broker(base: Path) -> Iterator[BrokerProcess]:
    with BrokerProcess(base / "store") as running:
        yield running


def norm(value: Any) -> Any:
    """What two stores given the same calls must agree on: ids and times differ."""
    if isinstance(value, SendResult):
        return ("SendResult", value.topic, value.queue_id, value.queue_offset, value.position)
    if isinstance(value, Message):
        return ("Message", *value[1:10])
    if isinstance(value, PullResult):
        return ("PullResult", [norm(m) for m in value], value.next_offset)
    if isinstance(value, list | tuple):
        return [norm(v) for v in value]
    return value


def outcome(op: Op, target: Any) -> Any:
    try:
        return ("ok", norm(op(target)))
    except EQueueError as exc:
        return ("error", type(exc).__name__)


LATER = time.time() + 3600
OPS: list[Op] = [
    lambda s: s.create_topic("a", 2),
    lambda s: s.send("a", b"one", tag="x", key="k1", properties={"p": "v"}, code=7, queue_id=1),
    lambda s: s.send("a", b"two"),
    lambda s: s.send_batch(
        "a",
        [
            b"three",
            OutgoingMessage(b"four", tag="y", key="k1"),
            {"body": b"five", "queue_id": 0, "code": -3},
            bytearray(b"six"),
        ],
    ),
    lambda s: s.send("auto", b"created on first send"),
    lambda s: s.pull("a", 0, 0),
    lambda s: s.pull("a", 1, 0, max_count=1),
    lambda s: s.pull("a", 0, 0, tags="y"),
    lambda s: s.pull("a", 0, 0, tags=["x", "y"]),
    lambda s: s.pull("a", 0, 0, tags="*"),
    lambda s: s.pull("a", 0, 0, max_bytes=1),
    lambda s: s.pull("a", 0, 99),
    lambda s: s.pull("a", 0, 0, wait=0.05),
    lambda s: s.pull("a", 0, 3, wait=0.05),  # nothing arrives: empty after the wait
    lambda s: s.query_by_key("a", "k1"),
    lambda s: s.query_by_key("a", "k1", limit=1),
    lambda s: s.query_by_key("a", "none"),
    lambda s: s.offset_for_time("a", 0, 0),
    lambda s: s.offset_for_time("a", 0, LATER),
    lambda s: s.offset_for_time("a", 1, dt.datetime.fromtimestamp(LATER, dt.UTC)),
    lambda s: s.commit_offset("g", "a", 0, 1),
    lambda s: s.committed_offset("g", "a", 0),
    lambda s: s.committed_offset("g", "a", 1),
    lambda s: s.committed_offset("g", "a", -1),
    lambda s: s.topics(),
    lambda s: s.deleted_topics(),
    lambda s: s.queue_ids("a"),
    lambda s: s.queue_range("a", 0),
    lambda s: s.create_topic("a", 3),
    lambda s: s.queue_ids("a"),
    lambda s: s.get(s.send("a", b"get me", key="g").message_id),
    # refused: each side must raise the same class, and store nothing
    lambda s: s.pull("missing", 0, 0),
    lambda s: s.pull("a", 7, 0),
    lambda s: s.pull("a", -1, 0),
    lambda s: s.pull("a", 0, -1),
    lambda s: s.pull("a", 0, 0, max_count=0),
    lambda s: s.pull("a", 0, 0, tags=[]),
    lambda s: s.pull("a", 0, 0, tags=5),
    lambda s: s.pull("a", 0, 0, wait=-1),
    lambda s: s.pull("a", 0, 0, wait="1"),
    lambda s: s.pull("a", 0, 0, max_bytes=0),
    lambda s: s.send("bad topic!", b"x"),
    lambda s: s.send("", b"x"),
    lambda s: s.send(5, b"x"),
    lambda s: s.send("a", "str body"),
    lambda s: s.send("a", b"x", tag=5),
    lambda s: s.send("a", b"x", tag="t" * 300),
    lambda s: s.send("a", b"x", key=b"k"),
    lambda s: s.send("a", b"x", properties={"a": 1}),
    lambda s: s.send("a", b"x", properties=[("a", "b")]),
    lambda s: s.send("a", b"x", code=1 << 40),
    lambda s: s.send("a", b"x", code=True),
    lambda s: s.send("a", b"x", queue_id=99),
    lambda s: s.send("a", b"x", queue_id=-1),
    lambda s: s.send("a", b"x", queue_id="0"),
    lambda s: s.send("a", b"x" * (4 * 1024 * 1024 + 1)),
    lambda s: s.send_batch("a", [b"ok", 5]),
    lambda s: s.send_batch("a", [b"ok", {"body": b"x", "tag": 5}]),
    lambda s: s.send_batch("a", [b"ok", {"bodie": b"x"}]),
    lambda s: s.send_batch("a", "abc"),
    lambda s: s.send_batch("bad topic", [b"x"]),
    lambda s: s.get("0" * 24),
    lambda s: s.get("nonsense"),
    lambda s: s.get(5),
    lambda s: s.query_by_key("a", "k", limit=0),
    lambda s: s.query_by_key("a", 5),
    lambda s: s.query_by_key("missing", "k"),
    lambda s: s.offset_for_time("a", 0, dt.datetime(2024, 1, 1)),
    lambda s: s.offset_for_time("a", 0, "now"),
    lambda s: s.offset_for_time("a", 0, float("nan")),
    lambda s: s.offset_for_time("missing", 0, 0),
    lambda s: s.commit_offset("g", "a", 0, 10**6),
    lambda s: s.commit_offset("", "a", 0, 0),
    lambda s: s.commit_offset(5, "a", 0, 0),
    lambda s: s.commit_offset("g", "a", 0, -1),
    lambda s: s.commit_offset("g", "missing", 0, 0),
    lambda s: s.committed_offset("g", "a", "0"),
    lambda s: s.create_topic("a", 0),
    lambda s: s.create_topic("a", 2000),
    lambda s: s.create_topic("a", "2"),
    lambda s: s.create_topic("bad name", 1),
    lambda s: s.queue_ids("missing"),
    lambda s: s.queue_range("a", 99),
    lambda s: s.queue_range("a", True),
    # nothing of the refused calls was stored
    lambda s: [s.pull("a", q, 0, max_count=100) for q in s.queue_ids("a")],
    lambda s: s.topics(),
]


def test_every_method_gives_what_the_store_gives(broker: BrokerProcess, tmp_path: Path) -> None:
    store = MessageStore.open(tmp_path / "model", StoreConfig(flush="async"))
    client = equeue.connect(broker.url, timeout=20)
    try:
        for index, op in enumerate(OPS):
            expected = outcome(op, store)
            assert outcome(op, client) == expected, f"op {index}"
        assert client.welcome is not None and client.welcome.version == PROTOCOL_VERSION
        client.ping()
        assert client.stats()["connections"] >= 1
    finally:
        client.close()
        store.close()


def test_the_asyncio_client_gives_what_the_sync_client_gives(broker: BrokerProcess) -> None:
    """The same ops through equeue.aio (each awaited), on a second topic set: the broker's
    store already holds the sync run's, so both clients run on a fresh store each."""
    sync_results = []
    with equeue.connect(broker.url) as client:
        sync_results = [outcome(op, client) for op in OPS]
    broker.stop()
    broker.store = broker.store.parent / "store2"
    broker.start()

    class Awaiting:
        """The aio client's methods as blocking calls (each run to its end)."""

        def __init__(self, client: equeue.aio.AsyncClient, loop: asyncio.AbstractEventLoop):
            self.client, self.loop = client, loop

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.client, name)
            return lambda *a, **k: self.loop.run_until_complete(method(*a, **k))

    loop = asyncio.new_event_loop()
    try:
        aio = loop.run_until_complete(equeue.aio.connect(broker.url))
        facade = Awaiting(aio, loop)
        aio_results = [outcome(op, facade) for op in OPS]
        loop.run_until_complete(aio.close())
    finally:
        loop.close()
    assert aio_results == sync_results


def test_many_coroutines_share_one_aio_client(broker: BrokerProcess) -> None:
    """200 coroutines, 25 sends each, and long-poll pulls answered after later sends:
    every answer reaches its own caller (its SendResult reads back its own body)."""

    async def main() -> None:
        client = await equeue.aio.connect(broker.url)
        await client.create_topic("p", 4)
        waiting = asyncio.ensure_future(client.pull("p", 3, 0, wait=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # held by the broker while the sends go by

        async def producer(n: int) -> list[tuple[bytes, SendResult]]:
            sent = []
            for i in range(25):
                body = f"{n}:{i}".encode()
                sent.append((body, await client.send("p", body, queue_id=n % 3)))
            return sent

        runs = await asyncio.gather(*(producer(n) for n in range(200)))
        assert not waiting.done()  # queue 3 got nothing yet
        last = await client.send("p", b"for the waiting pull", queue_id=3)
        held = await asyncio.wait_for(waiting, 30)
        assert [m.body for m in held] == [b"for the waiting pull"]
        assert held[0].message_id == last.message_id
        for sent in runs:
            for body, result in sent:
                assert (await client.get(result.message_id)).body == body
        by_queue: dict[int, list[int]] = {}
        for sent in runs:
            for _, result in sent:
                by_queue.setdefault(result.queue_id, []).append(result.queue_offset)
        for offsets in by_queue.values():
            assert sorted(offsets) == list(range(len(offsets)))  # each offset once
        await client.close()

    asyncio.run(main())


def test_send_many_with_a_window_and_threads_sharing_a_sync_client(
    broker: BrokerProcess,
) -> None:
    """send_many's results are in the messages' order; threads sharing the client each
    get their own answers, while another thread's long-poll pull is held."""
    with equeue.connect(broker.url) as client:
        client.create_topic("w", 2)
        bodies = [f"m{i}".encode() for i in range(3000)]
        results = client.send_many("w", bodies, window=64)
        assert [r.queue_offset for r in results if r.queue_id == 0] == list(range(1500))
        pulled = []
        for queue_id in (0, 1):
            offset = 0
            while batch := client.pull("w", queue_id, offset, max_count=500):
                pulled += [(m.message_id, m.body) for m in batch]
                offset = batch.next_offset
        assert sorted(pulled) == sorted(
            (r.message_id, b) for r, b in zip(results, bodies, strict=True)
        )

        held: list[PullResult] = []
        waiter = threading.Thread(target=lambda: held.append(client.pull("w", 1, 1500, wait=30)))
        waiter.start()
        errors: list[BaseException] = []

        def producer(n: int) -> None:
            try:
                for i in range(100):
                    body = f"t{n}:{i}".encode()
                    result = client.send("w", body, queue_id=0)
                    assert client.get(result.message_id).body == body
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert waiter.is_alive() and not held  # the held pull did not block the others
        client.send("w", b"wake", queue_id=1)
        waiter.join(30)
        assert [m.body for m in held[0]] == [b"wake"]
        assert client.queue_range("w", 0) == (0, 1500 + 800)


def test_a_window_over_the_brokers_in_flight_limit_is_cut_to_it(base: Path) -> None:
    with (
        BrokerProcess(base / "store", "--max-in-flight", "8") as small,
        equeue.connect(small.url) as client,
    ):
        assert client.welcome is not None
        assert client.welcome.limits["max_in_flight"] == 8
        results = client.send_many("s", [b"x"] * 500, window=1000)  # no LimitExceeded
        assert len({r.message_id for r in results}) == 500

        client.create_topic("h", 1)

        async def held_pulls() -> list[Any]:
            """20 long-poll pulls on 8 places: 8 are held by the broker, the others wait
            for a place (the broker would refuse them with LimitExceededError), 5 of
            them are cancelled while they wait; one send (another client) answers all."""
            async with await equeue.aio.connect(small.url) as aio:
                pulls = [asyncio.ensure_future(aio.pull("h", 0, 0, wait=30)) for _ in range(20)]
                await asyncio.sleep(0.2)
                assert not any(task.done() for task in pulls)
                for task in pulls[10:15]:
                    task.cancel()
                client.send("h", b"for all")
                return await asyncio.wait_for(asyncio.gather(*pulls, return_exceptions=True), 60)

        done = asyncio.run(held_pulls())
        assert [type(r) for r in done[10:15]] == [asyncio.CancelledError] * 5
        kept = done[:10] + done[15:]
        assert all(isinstance(r, PullResult) for r in kept), kept
        assert {m.body for r in kept for m in r} == {b"for all"}


READ_ONLY_CHILD = """
import json, sys
from equeue import MessageStore
store = MessageStore.open(sys.argv[1], read_only=True)
out = {}
for topic in store.topics():
    for q in store.queue_ids(topic):
        out[f"{topic}/{q}"] = [[m.message_id, m.body.hex()] for m in store.pull(topic, q, 0, 10000)]
print(json.dumps(out))
"""


def test_a_read_only_handle_in_another_process_sees_what_clients_sent(
    broker: BrokerProcess,
) -> None:
    with equeue.connect(broker.url) as client:
        client.send_batch("r", [f"b{i}".encode() for i in range(50)])
        client.send_many("r", [f"c{i}".encode() for i in range(50)])
        seen_by_client = {}
        for topic in client.topics():
            for q in client.queue_ids(topic):
                batch = client.pull(topic, q, 0, 10000)
                seen_by_client[f"{topic}/{q}"] = [[m.message_id, m.body.hex()] for m in batch]
    child = subprocess.run(
        [sys.executable, "-c", READ_ONLY_CHILD, str(broker.store)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    seen_by_reader = json.loads(child.stdout)
    assert seen_by_reader == seen_by_client
    assert sum(len(v) for v in seen_by_reader.values()) == 100


_INHERITED: list[Any] = []  # the parent's client, which a forked child inherits


def _send_in_child(n: int) -> str:
    result: SendResult = _INHERITED[0].send("f", f"child {n}".encode())
    return result.message_id


def test_a_forked_child_gets_its_own_connection(broker: BrokerProcess) -> None:
    """A client made before a fork (a gunicorn worker, a multiprocessing pool) works in
    the child and goes on working in the parent: each has its own connection."""
    import multiprocessing

    with equeue.connect(broker.url) as client:
        client.send("f", b"parent before")
        _INHERITED[:] = [client]
        try:
            with multiprocessing.get_context("fork").Pool(2) as pool:
                ids = pool.map(_send_in_child, range(4))
        finally:
            _INHERITED.clear()
        assert client.send("f", b"parent after").topic == "f"
        assert [client.get(i).body for i in ids] == [f"child {n}".encode() for n in range(4)]


def test_a_connection_on_a_descriptor_past_1023(broker: BrokerProcess) -> None:
    """A busy process has descriptors past select()'s 1023: the clients poll instead."""
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"RLIMIT_NOFILE is {soft}")
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with equeue.connect(broker.url) as client:
            assert client.send("d", b"x").topic == "d"
            assert client.pull("d", 0, 5, wait=0.05).messages == []  # waits, then empty

            async def with_aio() -> str:
                async with await equeue.aio.connect(broker.url) as aio:
                    await aio.ping()
                    return (await aio.send("d", b"y")).topic

            assert asyncio.run(with_aio()) == "d"
    finally:
        for fd in fillers:
            os.close(fd)


def test_send_many_stops_at_an_error_answer_and_says_what_was_stored(
    broker: BrokerProcess,
) -> None:
    """One message of 100 is refused by the store (over max_message_size): send_many
    raises that error once the chunks in flight are answered; ``sent`` are exactly the
    stored ones, ``unsent`` the others (the refused chunk's, and those never written)."""
    from equeue.client.many import PARTS
    from equeue.errors import MessageTooLargeError

    chunk = 16 // PARTS  # the window's chunks: one starts at 40
    bodies = [f"m{i}".encode() for i in range(100)]
    bodies[40] = b"x" * (4 * 1024 * 1024 + 1)
    with equeue.connect(broker.url) as client:
        client.create_topic("e", 1)
        with pytest.raises(MessageTooLargeError) as raised:
            client.send_many("e", bodies, window=16)
        sent = raised.value.sent
        unsent = list(raised.value.unsent)
        stored = client.pull("e", 0, 0, max_count=1000).messages
    # Changed with send_many's chunks (equeue/client/many.py): a chunk is all or nothing,
    # so the refused message's chunk-mates (41.. in its chunk) are unsent with it,
    # and sent + unsent now hold every message (the refused one was in neither before).
    assert [(r.message_id, r.queue_offset) for r in sent] == [
        (m.message_id, m.queue_offset) for m in stored
    ]  # sent is exactly what the store holds
    assert [m.body for m in stored] == [b for b in bodies if b not in unsent]
    assert len(sent) + len(unsent) == len(bodies)
    assert [m.body for m in stored[:40]] == bodies[:40]  # everything before the refused chunk
    assert unsent[:chunk] == bodies[40 : 40 + chunk]  # the refused chunk
    assert unsent[chunk:] == bodies[len(bodies) - len(unsent) + chunk :] and unsent[chunk:]
