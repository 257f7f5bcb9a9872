"""Protocol version 2's send_bodies (a batch of bodies alone, answered in columns): the
clients use it for a send_batch of bytes, fall back to send_batch against a broker of
version 1, and the broker refuses hostile ones as it refuses a bad send_batch; and the
broker's event-loop setting (uvloop or asyncio's)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer
from server_helpers import raw, short_home

import equeue
import equeue.aio
from equeue import MessageStore, StoreConfig
from equeue.client.coalesce import Coalescer
from equeue.errors import (
    ConfigError,
    ConnectionLostError,
    LimitExceededError,
    ProtocolError,
    StorePathError,
)
from equeue.protocol.frames import BODIES_VERSION, STATUS_ERROR, STATUS_OK
from equeue.server import BrokerThread
from equeue.server.config import ServerConfig
from equeue.server.loops import loop_factory

BODIES = [b"a" * 10, b"", b"c" * 300, b"d"]


home = pytest.fixture(short_home, name="home")


def _both(url: str, topic: str) -> list[Any]:
    """send_batch of BODIES from the sync client, then from the asyncio client."""
    client = equeue.connect(url, timeout=20)
    try:
        first = client.send_batch(topic, BODIES)
        version = client.welcome.version if client.welcome else 0
    finally:
        client.close()

    async def aio() -> list[Any]:
        async with await equeue.aio.connect(url, timeout=20) as c:
            return await c.send_batch(topic, BODIES)

    return [version, first, asyncio.run(aio())]


def _model(path: Path, topic: str) -> list[Any]:
    with MessageStore.open(path, StoreConfig(flush="async")) as store:
        return [store.send_batch(topic, BODIES), store.send_batch(topic, BODIES)]


def _places(results: list[Any]) -> list[tuple[Any, ...]]:
    """What a SendResult says but its message id's store prefix and its time."""
    return [(r.topic, r.queue_id, r.queue_offset, r.position, type(r.stored_at)) for r in results]


def test_a_batch_of_bodies_goes_as_send_bodies_and_gives_what_the_store_gives(home: Path) -> None:
    with BrokerThread(home / "store") as broker:
        version, first, second = _both(broker.urls[0], "t")
        stats = broker.broker.handlers.stats()
        bodies = [broker.store.get(r.message_id).body for r in first + second]
    assert version >= BODIES_VERSION
    expected = _model(home / "model", "t")
    assert [_places(first), _places(second)] == [_places(r) for r in expected]
    assert bodies == BODIES + BODIES
    assert (stats["sends"], stats["send_requests"]) == (8, 2)


def test_a_broker_of_version_1_gets_send_batch_instead(home: Path) -> None:
    with BrokerThread(home / "store") as broker:
        broker.broker.welcome_versions = (1,)
        # A broker before version 2 has no send_bodies: the request would close the
        # connection (ProtocolError, unknown op) if the client sent it.
        del broker.broker.handlers.ops["send_bodies"]
        version, first, second = _both(broker.urls[0], "t")
        bodies = [broker.store.get(r.message_id).body for r in first + second]
    assert version == 1
    expected = _model(home / "model", "t")
    assert [_places(first), _places(second)] == [_places(r) for r in expected]
    assert bodies == BODIES + BODIES


def test_hostile_send_bodies_are_refused_and_store_nothing(home: Path) -> None:
    with BrokerThread(home / "store", max_batch_messages=3) as broker:
        url = broker.urls[0]
        with raw(url) as c:
            error = c.error("send_bodies", topic="t", bodies=[b"x"] * 4)
            assert error["code"] == LimitExceededError.__name__
            assert "max_batch_messages=3" in error["message"]
            assert c.call("ping") is None  # the connection stays
        with raw(url) as c, raw(url) as other:
            c.request("send_bodies", topic="t", bodies=[b"x", "not bin"])
            rid, status, payload = c.recv()
            assert (rid, status, payload["code"]) == (0, 1, ProtocolError.__name__)
            assert "each body must be bin" in payload["message"]
            with pytest.raises(ConnectionError):
                c.recv()  # closed
            assert other.call("ping") is None
        with raw(url) as c:
            error = c.error("send_bodies", topic="equeue.dlq.g", bodies=[b"x"])
            assert "equeue." in error["message"]
        assert "t" not in broker.store.topics()


@pytest.mark.parametrize(
    "answer",
    [
        ["t", ["id"], [0], [0], [0]],  # five items
        ["t", ["id"], [0, 1], [0], [0], [1.0]],  # arrays of two lengths
        ["t", ["id"], [-1], [0], [0], [1.0]],  # a negative queue id
        ["t", ["id"], [True], [0], [0], [1.0]],  # a bool for a uint
        ["t", [5], [0], [0], [0], [1.0]],  # a message id that is no str
        ["t", ["id"], [0], [0], [0], [1]],  # stored_at no float
    ],
)
def test_a_malformed_columns_answer_is_a_protocol_error(answer: list[Any]) -> None:
    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        request_id, op, args = peer.recv()
        assert (op, args["bodies"]) == ("send_bodies", [b"x"])
        peer.send([request_id, 0, answer])
        peer.recv()  # until the client closes

    with FakeBroker(script) as fake:
        client = equeue.connect(fake.url, timeout=5, connect_timeout=1)
        try:
            with pytest.raises(ProtocolError, match="send_bodies"):
                client.send_batch("t", [b"x"])
        finally:
            client.close()
        assert not fake.errors


@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_the_broker_serves_on_the_loop_chosen(home: Path, choice: str) -> None:
    if choice == "uvloop":
        pytest.importorskip("uvloop")
    seen: list[str] = []
    with BrokerThread(home / "store", event_loop=choice) as broker:
        broker.broker.loop.call_soon_threadsafe(
            lambda: seen.append(type(asyncio.get_running_loop()).__module__)
        )
        client = equeue.connect(broker.urls[0], timeout=20)
        try:
            assert client.send("t", b"x").queue_offset == 0
        finally:
            client.close()
    assert seen and seen[0].startswith(choice)


def test_an_event_loop_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="event_loop='trio'"):
        ServerConfig(event_loop="trio")  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(ConfigError, match="pip install uvloop"):
        loop_factory("uvloop")
    assert loop_factory("auto")[0] == "asyncio"  # the fallback where it is missing
    assert loop_factory("asyncio")[0] == "asyncio"


# --- the asyncio client's coalesced sends ------------------------------------------------


def test_concurrent_sends_are_coalesced_and_each_gets_what_the_store_gives(home: Path) -> None:
    calls = [("t" if i % 3 else "u", f"m{i}".encode()) for i in range(300)]

    async def produce(url: str) -> list[Any]:
        async with await equeue.aio.connect(url, timeout=20) as client:
            lanes = [calls[i::30] for i in range(30)]  # 30 tasks, 10 sends each in turn

            async def lane(items: list[tuple[str, bytes]]) -> list[Any]:
                return [await client.send(topic, body) for topic, body in items]

            done = await asyncio.gather(*(lane(items) for items in lanes))
            by_call: dict[bytes, Any] = {}
            for items, results in zip(lanes, done, strict=True):
                by_call.update((body, r) for (_, body), r in zip(items, results, strict=True))
            return [by_call[body] for _, body in calls]

    with BrokerThread(home / "store") as broker:
        results = asyncio.run(produce(broker.urls[0]))
        stats = broker.broker.handlers.stats()
        stored = [broker.store.get(r.message_id) for r in results]
    assert [(m.topic, m.body) for m in stored] == calls
    assert stats["sends"] == 300 and stats["send_requests"] < 100  # coalesced
    # Per topic, the queues and offsets of MessageStore.send in the order the broker got
    # them (the order of the stored positions).
    with MessageStore.open(home / "model", StoreConfig(flush="async")) as model:
        for topic in ("t", "u"):
            mine = sorted((r for r in results if r.topic == topic), key=lambda r: r.position)
            expected = [model.send(topic, b"x") for _ in mine]
            assert [(r.queue_id, r.queue_offset) for r in mine] == [
                (e.queue_id, e.queue_offset) for e in expected
            ]


def test_a_group_refused_whole_is_sent_again_one_by_one(home: Path) -> None:
    async def produce(url: str) -> list[Any]:
        async with await equeue.aio.connect(url, timeout=20) as client:
            await client.create_topic("t", 1)
            outcomes = await asyncio.gather(
                client.send("t", b"first"),  # alone: nothing is in flight yet
                client.send("t", b"ok"),  # these three in one send_bodies
                client.send("t", b"x" * (5 << 20)),  # past the store's max_message_size
                client.send("t", b"ok2"),
                return_exceptions=True,
            )
            return list(outcomes)

    with BrokerThread(home / "store") as broker:
        outcomes = asyncio.run(produce(broker.urls[0]))
        stored = [m.body for m in broker.store.pull("t", 0, 0, 10).messages]
    assert [type(o).__name__ for o in outcomes] == [
        "SendResult", "SendResult", "MessageTooLargeError", "SendResult",
    ]  # fmt: skip
    assert stored == [b"first", b"ok", b"ok2"]
    assert [o.queue_offset for o in outcomes if not isinstance(o, Exception)] == [0, 1, 2]


async def _sends(url: str, bodies: tuple[bytes, ...]) -> list[Any]:
    """A send of each body to topic t in one loop turn, from the asyncio client: the
    first alone, the others one send_bodies; each one's result or error."""
    client = await equeue.aio.connect(url, timeout=5, connect_timeout=1)
    try:
        async with asyncio.timeout(10):  # (a caller never answered fails the test)
            return await asyncio.gather(
                *(client.send("t", body) for body in bodies), return_exceptions=True
            )
    finally:
        await client.close()


def test_a_broken_connection_names_each_callers_own_message() -> None:
    seen: list[Any] = []

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        seen.extend(peer.recv()[1:] for _ in range(2))  # a send, then a send_bodies
        # closed without an answer

    with FakeBroker(script) as fake:
        outcomes = asyncio.run(_sends(fake.url, (b"a", b"b", b"c")))
        assert not fake.errors
    assert seen == [["send", {"topic": "t", "body": b"a"}],
                    ["send_bodies", {"topic": "t", "bodies": [b"b", b"c"]}]]  # fmt: skip
    for outcome, body in zip(outcomes, (b"a", b"b", b"c"), strict=True):
        assert isinstance(outcome, ConnectionLostError)
        assert [m.body for m in outcome.unanswered] == [body]


def test_an_error_whose_class_takes_keyword_arguments_reaches_every_caller_of_the_group() -> None:
    # StorePathError.__init__ requires file=: an error from the wire is built without it,
    # and each caller of the group gets its own instance of it (none is left waiting).
    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        first, group = peer.recv(), peer.recv()
        assert group[1:] == ["send_bodies", {"topic": "t", "bodies": [b"b", b"c", b"d"]}]
        peer.send([first[0], STATUS_OK, ["t", "id", 0, 0, 0, 1.0]])
        refused = {"code": "StorePathError", "message": "queues/t/0 is a symbolic link"}
        peer.send([group[0], STATUS_ERROR, refused])
        peer.recv()  # until the client closes

    with FakeBroker(script) as fake:
        outcomes = asyncio.run(_sends(fake.url, (b"a", b"b", b"c", b"d")))
        assert not fake.errors
    assert type(outcomes[0]).__name__ == "SendResult"
    errors = outcomes[1:]
    assert all(type(e) is StorePathError for e in errors), errors
    assert [str(e) for e in errors] == ["queues/t/0 is a symbolic link"] * 3
    assert len({id(e) for e in errors}) == 3  # each caller its own


class _Parked:
    """The protocol as Coalescer.resend sees it, with no place free until ``open``: the
    resend waits in place() as it does behind other sends."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.where, self.max_in_flight = loop, "fake", 4
        self.free, self.closed = 0, False
        self.waiters: list[asyncio.Future[None]] = []

    async def place(self) -> None:
        while self.free <= 0 and not self.closed:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            await waiter

    def open(self, *, closed: bool) -> None:
        self.closed, self.free = closed, 0 if closed else 4
        for waiter in self.waiters:
            waiter.set_result(None)

    def schedule(self) -> None:
        pass


class _Recording(Coalescer):
    """Records the bodies it would send (one request each) instead of sending them."""

    requested: list[bytes]

    def request(self, topic: str, group: list[Any]) -> None:
        self.requested.append(group[0][0])


@pytest.mark.parametrize("closed", [True, False])
def test_a_caller_cancelled_while_its_resend_waits_is_skipped(closed: bool) -> None:
    # A group refused whole is sent again one by one, each send waiting for a place. A
    # caller cancelled meanwhile is neither sent nor answered; the others still are (when
    # the connection broke meanwhile: ConnectionLostError).
    async def run() -> tuple[Any, list[Any], list[bytes]]:
        loop = asyncio.get_running_loop()
        protocol = _Parked(loop)
        coalescer = _Recording(protocol, 1 << 20, 65536)  # type: ignore[arg-type]
        requested = coalescer.requested = []
        bodies = (b"a", b"b", b"c")
        futures = [loop.create_future() for _ in bodies]
        group = [(body, f, (body, "t")) for body, f in zip(bodies, futures, strict=True)]
        task = loop.create_task(coalescer.resend("t", group))
        for _ in range(10):  # until it waits for a place
            await asyncio.sleep(0)
        assert protocol.waiters and not requested
        futures[0].cancel()
        protocol.open(closed=closed)
        await asyncio.wait_for(task, 5)
        return task.exception(), [f.done() for f in futures], requested

    error, done, requested = asyncio.run(run())
    assert error is None and done == [True, closed, closed]
    assert requested == ([] if closed else [b"b", b"c"])


def test_request_of_send_bodies_gives_the_columns_msgpack_decodes(home: Path) -> None:
    """request() promises the result as msgpack decodes it: for send_bodies the columns
    [topic, ids, queue_ids, offsets, positions, stored_at], not the C reader's SendResults;
    and a send_batch of bytes on the same client still gets its SendResults."""
    with BrokerThread(home / "store") as broker:
        client = equeue.connect(broker.urls[0], timeout=20)
        try:
            answer = client.request("send_bodies", {"topic": "t", "bodies": [b"a", b"b"]})
            results = client.send_batch("t", [b"c", b"d"])
        finally:
            client.close()
    assert isinstance(answer, list) and len(answer) == 6
    topic, ids, queue_ids, offsets, positions, stored = answer
    assert topic == "t" and len(ids) == 2 and all(isinstance(i, str) for i in ids)
    assert [len(c) for c in (queue_ids, offsets, positions, stored)] == [2, 2, 2, 2]
    assert positions[0] == 0 and all(isinstance(q, int) for q in queue_ids + offsets)
    assert [r.topic for r in results] == ["t", "t"] and results[0].position > positions[1]
