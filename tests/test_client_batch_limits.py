"""Batches and sizes at the clients (review 37b findings 1, 11, 12), both clients against
a real ``equeue serve``: a send_batch past the broker's msgpack-object bound or its
max_batch_messages is refused before sending (LimitExceededError; the connection, with
a pull held on it, stays), the broker answers an over-count request instead of closing
the connection, an answer with fewer SendResults than messages is a ProtocolError for
that request, and one body too large is MessageTooLargeError whatever its size."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from client_helpers import WELCOME, BrokerProcess, FakeBroker, Peer, temporary_broker
from server_helpers import raw

import equeue
import equeue.aio
from equeue.errors import (
    EQueueError,
    FrameTooLargeError,
    LimitExceededError,
    MessageTooLargeError,
    ProtocolError,
)
from equeue.protocol.frames import STATUS_OK
from equeue.store.types import PullResult

KINDS = ["sync", "aio"]
BATCH = 10  # the batch broker's --max-batch-messages: 320 objects a request past 64 KiB
OBJECTS = 32 * BATCH
SMALL_FRAME = 65536  # the small broker's --max-frame-bytes: bodies up to 30720 bytes


@pytest.fixture(scope="module")
def batch_broker() -> Iterator[BrokerProcess]:
    options = ("--max-frame-bytes", str(1 << 20), "--max-batch-messages", str(BATCH))
    with temporary_broker(*options) as running:
        yield running


@pytest.fixture(scope="module")
def small_frame() -> Iterator[BrokerProcess]:
    with temporary_broker("--max-frame-bytes", str(SMALL_FRAME)) as running:
        yield running


class Session:
    """One client of either kind, its calls run to their result (or error raised); an
    asyncio client's on one loop kept across calls (asyncio.Runner)."""

    def __init__(self, kind: str, url: str) -> None:
        self.runner: asyncio.Runner | None = None
        if kind == "sync":
            self.client: Any = equeue.connect(url, timeout=30)
        else:
            self.runner = asyncio.Runner()
            self.client = self.runner.run(equeue.aio.connect(url, timeout=30))

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.client, method)(*args)
        return result if self.runner is None else self.runner.run(result)

    def refused(self, error: type[EQueueError], method: str, *args: Any) -> EQueueError:
        with pytest.raises(error) as caught:
            self.call(method, *args)
        return caught.value

    def held_pull(self, topic: str) -> Callable[[], PullResult]:
        """A pull of ``topic``'s queue 0 held by the broker (up to 60 s) on this client's
        connection; the function waits for its result."""
        if self.runner is None:
            outcome: dict[str, Any] = {}

            def pull() -> None:
                try:
                    outcome["result"] = self.client.pull(topic, 0, 0, 32, None, 60.0)
                except EQueueError as exc:
                    outcome["result"] = exc

            thread = threading.Thread(target=pull, daemon=True)
            thread.start()

            def result() -> PullResult:
                thread.join(60)
                found = outcome["result"]
                if isinstance(found, EQueueError):
                    raise found
                return found  # type: ignore[no-any-return]

            return result

        async def start() -> asyncio.Task[PullResult]:
            task: asyncio.Task[PullResult] = asyncio.ensure_future(
                self.client.pull(topic, 0, 0, 32, None, 60.0)
            )
            await asyncio.sleep(0)  # (written)
            return task

        task = self.runner.run(start())
        runner = self.runner

        async def wait() -> PullResult:
            return await asyncio.wait_for(task, 60)

        return lambda: runner.run(wait())

    def close(self) -> None:
        if self.runner is None:
            self.client.close()
            return
        self.runner.run(self.client.close())
        self.runner.close()


@pytest.fixture(params=KINDS)
def session_of(request: pytest.FixtureRequest) -> Iterator[Callable[[BrokerProcess], Session]]:
    made: list[Session] = []

    def make(broker: BrokerProcess) -> Session:
        made.append(Session(request.param, broker.url))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _wait_held(url: str, count: int) -> None:
    with equeue.connect(url) as watcher:
        for _ in range(500):  # (bounded: 10 s)
            if watcher.stats()["held_pulls"] >= count:
                return
            time.sleep(0.02)
    raise AssertionError("the pull was not held")


def _stored(url: str, topic: str) -> int:
    with equeue.connect(url) as reader:
        if topic not in reader.topics():
            return 0
        return sum(reader.queue_range(topic, q)[1] for q in reader.queue_ids(topic))


def _batch(properties: list[int]) -> list[dict[str, Any]]:
    """Messages of 7 KB bodies (the request past 64 KiB: its objects counted) with so many
    properties each: 7 + 2 a property objects a message, 10 more the request's own."""
    return [
        {"body": b"%02d" % n + b"x" * 7000, "properties": {f"p{k}": "v" for k in range(count)}}
        for n, count in enumerate(properties)
    ]


def test_a_batch_past_the_objects_bound_is_refused_before_sending_and_a_held_pull_lives(
    batch_broker: BrokerProcess, session_of: Callable[[BrokerProcess], Session]
) -> None:
    """Before: the broker closed the connection (ProtocolError), every request on it, the
    held pull too, failed with ConnectionLostError; send_many stored the same messages
    (split into requests within the bound; test_send_many.py)."""
    session = session_of(batch_broker)
    topic = f"objs-{id(session)}"
    session.call("create_topic", topic, 1)
    session.call("create_topic", f"{topic}-held", 1)
    held = session.held_pull(f"{topic}-held")
    _wait_held(batch_broker.url, 1)
    messages = _batch([20] * BATCH)  # 10 messages (the most a batch may) of 20 properties
    error = session.refused(LimitExceededError, "send_batch", topic, messages)
    text = str(error)
    assert f"holds {10 + BATCH * (7 + 2 * 20)} msgpack objects" in text, text
    assert f"at most {OBJECTS}" in text and "per request" in text, text
    assert f"max_batch_messages={BATCH}" in text and "--max-batch-messages" in text, text
    assert "smaller batches" in text and "send_many" in text, text
    assert _stored(batch_broker.url, topic) == 0  # nothing sent
    with equeue.connect(batch_broker.url) as other:
        sent = other.send(f"{topic}-held", b"wakes the held pull", queue_id=0)
    assert [m.message_id for m in held().messages] == [sent.message_id]  # its connection lived
    for half in (messages[: BATCH // 2], messages[BATCH // 2 :]):  # split: each within
        assert len(session.call("send_batch", topic, half)) == BATCH // 2
    assert _stored(batch_broker.url, topic) == BATCH


def test_the_clients_count_objects_as_the_broker_does(
    batch_broker: BrokerProcess, session_of: Callable[[BrokerProcess], Session]
) -> None:
    """At the bound (320 objects: 10 messages of 12 properties) the client sends and the
    broker stores; one property more (322) the client refuses, and so does the broker
    (a raw connection), with an error answer: the connection stays."""
    session = session_of(batch_broker)
    topic = f"edge-{id(session)}"
    at_bound = _batch([12] * BATCH)
    over = _batch([13] + [12] * (BATCH - 1))
    assert len(session.call("send_batch", topic, at_bound)) == BATCH
    error = session.refused(LimitExceededError, "send_batch", topic, over)
    assert f"holds {OBJECTS + 2} msgpack objects" in str(error), error
    with raw(batch_broker.url) as connection:
        answer = connection.error("send_batch", topic=topic, messages=over)
        assert answer["code"] == "LimitExceededError", answer
        assert connection.call("ping") is None  # the connection stays
        assert len(connection.call("send_batch", topic=topic, messages=at_bound)) == BATCH
    assert _stored(batch_broker.url, topic) == 2 * BATCH


def test_the_broker_answers_a_request_past_the_objects_bound_and_keeps_the_connection(
    batch_broker: BrokerProcess,
) -> None:
    """Before: ProtocolError with request id 0 blaming --max-batch-messages for a batch of
    10 messages, and the connection closed with the pull held on it."""
    topic = "raw-objects"
    with raw(batch_broker.url) as connection, equeue.connect(batch_broker.url) as other:
        connection.call("create_topic", topic=topic, queue_count=1)
        pull = connection.request("pull", topic=topic, queue_id=0, offset=0, wait_ms=60_000)
        _wait_held(batch_broker.url, 1)
        refused = connection.request("send_batch", topic=topic, messages=_batch([40] * BATCH))
        request_id, status, payload = connection.recv()
        assert (request_id, status) == (refused, 1), (request_id, status, payload)
        assert payload["code"] == "LimitExceededError", payload
        text = payload["message"]
        assert f"more than {OBJECTS} msgpack objects" in text and "per request" in text, text
        assert "a send_batch of" not in text  # not blamed on the batch's message count
        assert _stored(batch_broker.url, topic) == 0
        sent = other.send(topic, b"for the held pull")
        request_id, status, payload = connection.recv()
        assert (request_id, status) == (pull, STATUS_OK)
        assert payload[0][0][0] == sent.message_id
        assert connection.call("ping") is None


def test_a_batch_past_max_batch_messages_is_refused_before_sending(
    batch_broker: BrokerProcess, session_of: Callable[[BrokerProcess], Session]
) -> None:
    """70,000 bodies: past the 65,536 items an array of a request may hold, so before, the
    broker closed the connection (ProtocolError); 11 the broker refused with an answer."""
    session = session_of(batch_broker)
    topic = f"count-{id(session)}"
    for count, body in ((BATCH + 1, b"x"), (70_000, b"x"), (BATCH + 1, {"body": b"x", "tag": "t"})):
        error = session.refused(LimitExceededError, "send_batch", topic, [body] * count)
        text = str(error)
        assert f"a send_batch of {count} messages" in text, text
        assert f"max_batch_messages={BATCH}" in text and "send_many" in text, text
    assert _stored(batch_broker.url, topic) == 0
    assert len(session.call("send_batch", topic, [b"y"] * BATCH)) == BATCH  # the same client


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bodies", [True, False], ids=["send_bodies", "send_batch"])
def test_an_answer_with_fewer_results_than_messages_is_a_protocol_error(
    kind: str, bodies: bool
) -> None:
    """Before: both clients returned the one SendResult for two messages."""

    def script(peer: Peer) -> None:
        peer.recv()  # the hello
        peer.send({**WELCOME, "version": 2})
        request_id, op, _ = peer.recv()
        assert op == ("send_bodies" if bodies else "send_batch"), op
        if bodies:  # SendResults in columns: one for two bodies
            peer.send([request_id, STATUS_OK, ["t", ["0" * 24], [0], [0], [0], [1.0]]])
        else:
            peer.send([request_id, STATUS_OK, [["0" * 24, "t", 0, 0, 0, 1.0]]])
        request_id, op, _ = peer.recv()
        assert op == "ping"
        peer.send([request_id, STATUS_OK, None])
        peer.recv()  # until the client closes

    messages: list[Any] = [b"a", b"b"] if bodies else [{"body": b"a", "tag": "x"}, b"b"]
    with FakeBroker(script) as fake:
        session = Session(kind, fake.url)
        try:
            error = session.refused(ProtocolError, "send_batch", "t", messages)
            assert "1 SendResults answer a send_batch of 2 messages" in str(error), error
            assert session.call("ping") is None  # the connection stays
        finally:
            session.close()
        assert fake.connections == 1


@pytest.mark.parametrize("size", [30_721, 65_000, 70_000, 5 << 20])
def test_one_body_too_large_is_message_too_large_whatever_its_size(
    small_frame: BrokerProcess, session_of: Callable[[BrokerProcess], Session], size: int
) -> None:
    """Before: 30,721 and 65,000 bytes were MessageTooLargeError (the broker's answer),
    70,000 and 5 MiB FrameTooLargeError (the client's frame check), a ProtocolError."""
    session = session_of(small_frame)
    error = session.refused(MessageTooLargeError, "send", "big", b"x" * size)
    text = str(error)
    assert "--max-frame-bytes" in text and f"max_frame_bytes={SMALL_FRAME}" in text, text
    assert f"{size} bytes" in text, text
    assert session.call("ping") is None


def test_a_batch_over_the_frame_names_send_batch_and_one_body_too_large_is_message_too_large(
    small_frame: BrokerProcess, session_of: Callable[[BrokerProcess], Session]
) -> None:
    """Before: "a send_bodies request of 80043 bytes", an op the caller never used; and a
    batch holding one body no frame carries was FrameTooLargeError, "split the batch"."""
    session = session_of(small_frame)
    topic = f"frame-{id(session)}"
    error = session.refused(FrameTooLargeError, "send_batch", topic, [b"y" * 20_000] * 4)
    text = str(error)
    assert "a send_batch request of 800" in text and "send_bodies" not in text, text
    assert "send_many" in text, text
    for big in ([b"a", b"x" * 70_000], [{"body": b"a", "tag": "t"}, {"body": b"x" * 70_000}]):
        error = session.refused(MessageTooLargeError, "send_batch", topic, big)
        text = str(error)
        assert "message 1 of the send_batch" in text and "70000 bytes" in text, text
        assert f"max_frame_bytes={SMALL_FRAME}" in text and "--max-frame-bytes" in text, text
    assert _stored(small_frame.url, topic) == 0
    assert session.call("ping") is None


def test_coalesced_sends_keep_within_max_batch_messages(batch_broker: BrokerProcess) -> None:
    """100 sends in one loop turn on an asyncio client of a broker taking 10 messages a
    batch: coalesced into groups of at most 10 (the encoder would refuse a larger one),
    every send stored and answered its own SendResult."""
    topic = "coalesced"
    with equeue.connect(batch_broker.url) as reader:
        errors = reader.stats()["errors"]

    async def main() -> list[Any]:
        async with await equeue.aio.connect(batch_broker.url, timeout=30) as client:
            await client.create_topic(topic, 1)
            bodies = [b"%03d" % n for n in range(100)]
            return await asyncio.gather(*(client.send(topic, body) for body in bodies))

    results = asyncio.run(main())
    assert [r.queue_offset for r in results] == list(range(100))  # in order, each its own
    with equeue.connect(batch_broker.url) as reader:
        stored = reader.pull(topic, 0, 0, 100).messages
        assert [m.body for m in stored] == [b"%03d" % n for n in range(100)]
        assert reader.stats()["errors"] == errors  # no group refused by the broker, resent
