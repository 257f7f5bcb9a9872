"""The asyncio client's fast path for plain sends (the loop turn's group, answered from
the read): a random mix of sends, send_batches, refused calls and cancellations, all
started in one loop turn on one client of a real broker, each caller getting its own
outcome, the one MessageStore gives for that call; and the client on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import equeue.aio
from equeue import MessageStore, SendResult, StoreConfig
from equeue.errors import EQueueError, MessageTooLargeError, ProtocolError
from equeue.protocol.frames import BODIES_VERSION, STATUS_OK
from equeue.server import BrokerThread

_EXAMPLES = itertools.count()
TOPICS = ("a", "b")  # created by the fixture, 2 and 1 queues
# (kind, topic, options, cancel after this many loop turns or None); the body is made
# unique per call by the test
CALL = st.tuples(
    st.sampled_from(["send", "send", "send", "batch"]),
    st.sampled_from(["a", "a", "b", "bad topic"]),
    st.sampled_from([{}, {}, {}, {"tag": "x"}, {"key": "k"}, {"queue_id": 0}, {"queue_id": 7},
                     {"body": "not bytes"}, {"batch_bad": True}]),
    st.sampled_from([None, None, None, 0, 1, 2]),
)  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[BrokerThread, MessageStore]]:
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    with contextlib.ExitStack() as stack:  # (undone in reverse: the directory last)
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        model = stack.enter_context(MessageStore.open(base / "model", StoreConfig(flush="async")))
        broker = stack.enter_context(BrokerThread(base / "store"))
        for store in (broker.store, model):
            store.create_topic("a", 2)
            store.create_topic("b", 1)
        yield broker, model


def _invoke(target: Any, kind: str, topic: str, options: dict[str, Any], body: bytes) -> Any:
    """The call on a client (a coroutine) or on MessageStore (its result)."""
    options = dict(options)
    if kind == "batch":
        bad = options.pop("batch_bad", False)
        items: list[Any] = [body + b".0", body + b".1"] + (["not bytes"] if bad else [])
        return target.send_batch(topic, items)
    options.pop("batch_bad", None)
    return target.send(topic, options.pop("body", body), **options)


def _outcome(call: Any) -> Any:
    try:
        result = call()
    except EQueueError as exc:
        return type(exc).__name__
    return "ok" if isinstance(result, (SendResult, list)) else result


async def _run_all(url: str, calls: list[tuple[Any, ...]], tag: int) -> list[Any]:
    """Every call started in one loop turn on one client; each caller's outcome."""
    async with await equeue.aio.connect(url, timeout=30) as client:
        await client.ping()  # (the fast path needs a welcomed connection)

        async def one(index: int, kind: str, topic: str, options: dict[str, Any]) -> Any:
            return await _invoke(client, kind, topic, options, f"{tag}:{index}".encode())

        tasks = [
            asyncio.ensure_future(one(i, kind, topic, options))
            for i, (kind, topic, options, _) in enumerate(calls)
        ]
        for turn in range(3):  # cancel each after its number of loop turns
            for task, (_, _, _, cancel) in zip(tasks, calls, strict=True):
                if cancel == turn:
                    task.cancel()
            await asyncio.sleep(0)
        async with asyncio.timeout(30):  # (a caller never answered fails the test)
            outcomes = list(await asyncio.gather(*tasks, return_exceptions=True))
            protocol = client._protocol
            assert protocol is not None
            while protocol.pending:  # (cancelled callers' requests: still answered)
                await asyncio.sleep(0.001)
        # Every place came back, none twice: a send holds one until its group's answer.
        assert (protocol.free, protocol.closed) == (protocol.max_in_flight, False)
        return outcomes


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(calls=st.lists(CALL, min_size=1, max_size=30))
def test_a_random_mix_through_one_client_gets_every_caller_its_own_outcome(
    pair: tuple[BrokerThread, MessageStore], calls: list[tuple[Any, ...]]
) -> None:
    broker, model = pair
    tag = next(_EXAMPLES)  # (bodies unique across examples)
    outcomes = asyncio.run(_run_all(broker.urls[0], calls, tag))
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len({id(e) for e in errors}) == len(errors)  # each caller its own instance
    for index, ((kind, topic, options, cancel), got) in enumerate(
        zip(calls, outcomes, strict=True)
    ):
        body = f"{tag}:{index}".encode()
        if isinstance(got, asyncio.CancelledError):
            assert cancel is not None
            continue
        expected = _outcome(lambda: _invoke(model, kind, topic, options, body))  # noqa: B023
        if expected != "ok":
            assert type(got).__name__ == expected, (kind, topic, options, got)
            continue
        results = got if kind == "batch" else [got]
        assert isinstance(got, (SendResult, list)), (kind, topic, options, got)
        bodies = [body + b".0", body + b".1"] if kind == "batch" else [body]
        for result, sent in zip(results, bodies, strict=True):
            stored = broker.store.get(result.message_id)  # the caller's own message
            assert (stored.body, stored.topic) == (sent, topic)
            assert (stored.queue_id, stored.queue_offset) == (
                result.queue_id,
                result.queue_offset,
            )
            if kind == "batch":  # (its options are not used)
                continue
            assert stored.tag == options.get("tag", "") and stored.key == options.get("key")
            if "queue_id" in options:
                assert result.queue_id == options["queue_id"]
    # Stored once each: no send went twice (a cancelled one may have gone once).
    held: list[bytes] = []
    for topic in TOPICS:
        for queue_id in broker.store.queue_ids(topic):
            offset = 0
            while batch := broker.store.pull(topic, queue_id, offset, max_count=1000):
                held += [m.body for m in batch if m.body.startswith(f"{tag}:".encode())]
                offset = batch.next_offset
    assert len(held) == len(set(held))


def test_the_asyncio_client_runs_on_uvloop(tmp_path: Path) -> None:
    # uvloop's transports are not asyncio.Transport subclasses: an isinstance check in
    # connection_made refused every connection (a connect_timeout after 5 s).
    uvloop = pytest.importorskip("uvloop")
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))

    async def produce(url: str) -> list[Any]:
        async with await equeue.aio.connect(url, timeout=20, connect_timeout=5) as client:
            first = await client.send("u", b"alone")
            rest = await asyncio.gather(*(client.send("u", b"%d" % i) for i in range(50)))
            return [first, *rest, (await client.pull("u", first.queue_id, 0)).messages[0].body]

    try:
        with BrokerThread(base / "store") as broker:
            loop = uvloop.new_event_loop()
            try:
                found = loop.run_until_complete(produce(broker.urls[0]))
            finally:
                loop.close()
            assert all(type(r) is SendResult for r in found[:-1])
            assert found[-1] == b"alone"
            assert broker.store.get(found[1].message_id).body == b"0"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _script_welcome(peer: Peer, max_frame_bytes: int = 1 << 20) -> None:
    peer.recv()
    limits = {**WELCOME["limits"], "max_frame_bytes": max_frame_bytes}
    peer.send({**WELCOME, "version": BODIES_VERSION, "limits": limits})


def test_a_groups_answer_of_the_wrong_length_fails_each_caller_and_the_connection() -> None:
    # A broker answering a send_bodies of 3 with 2 results: each of the 3 callers gets
    # its own ProtocolError (none left waiting, none given another's result), and the
    # connection is closed; the next call connects again.
    def script(peer: Peer) -> None:
        _script_welcome(peer)
        first, group = peer.recv(), peer.recv()
        assert group[1:] == ["send_bodies", {"topic": "t", "bodies": [b"b", b"c", b"d"]}]
        peer.send([first[0], STATUS_OK, ["t", "id", 0, 0, 0, 1.0]])
        peer.send([group[0], STATUS_OK, ["t", ["i1", "i2"], [0, 0], [1, 2], [1, 2], [1.0, 1.0]]])
        peer.recv()  # until the client closes

    async def run(url: str) -> tuple[list[Any], list[Any]]:
        client = await equeue.aio.connect(url, timeout=5, connect_timeout=5)
        try:
            async with asyncio.timeout(10):
                outcomes = await asyncio.gather(
                    *(client.send("t", body) for body in (b"a", b"b", b"c", b"d")),
                    return_exceptions=True,
                )
                protocol = client._protocol
                assert protocol is not None
                return list(outcomes), [protocol.closed, protocol.pending]
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        outcomes, (closed, pending) = asyncio.run(run(fake.url))
    assert type(outcomes[0]) is SendResult
    errors = outcomes[1:]
    assert all(type(e) is ProtocolError for e in errors), errors
    assert "2 results for a send_bodies of 3" in str(errors[0])
    assert len({id(e) for e in errors}) == 3
    assert closed and not pending


def test_a_send_past_max_frame_bytes_fails_alone_and_the_connection_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A group whose only body is past max_frame_bytes (a send in flight, so it is not
    # alone): its caller gets MessageTooLargeError (as from the store), nothing is
    # written for it, and the connection stays: the next send goes and is answered.
    def script(peer: Peer) -> None:
        _script_welcome(peer, max_frame_bytes=1024)
        ping = peer.recv()
        peer.send([ping[0], STATUS_OK, None])
        for turn in range(2):  # the send in flight, then the big one's turn: only the next
            request = peer.recv()
            assert request[1:] == ["send", {"topic": "t", "body": b"small"}], request
            if turn == 0:  # (answered late: the big send finds it in flight, as a group)
                time.sleep(0.5)
            peer.send([request[0], STATUS_OK, ["t", "id", 0, 0, 0, 1.0]])
        peer.recv()  # until the client closes

    async def run(url: str) -> list[Any]:
        async with await equeue.aio.connect(url, timeout=5, connect_timeout=5) as client:
            await client.ping()
            async with asyncio.timeout(10):
                in_flight = asyncio.ensure_future(client.send("t", b"small"))
                await asyncio.sleep(0)  # written: in flight
                big = await asyncio.gather(client.send("t", b"x" * 2000), return_exceptions=True)
                return [await in_flight, *big, await client.send("t", b"small")]

    with caplog.at_level(logging.ERROR), FakeBroker(script) as fake:
        outcomes = asyncio.run(run(fake.url))
    assert [type(o) for o in outcomes] == [SendResult, MessageTooLargeError, SendResult]
    assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()]


def test_coalesced_sends_keep_to_a_small_max_in_flight() -> None:
    # 30 coroutines sending in turn through a broker allowing 4 requests in flight: a
    # send holds a place until its group is answered, so groups stay within 4 sends
    # and no request is refused with LimitExceededError; every place comes back.
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))

    async def produce(url: str) -> tuple[list[Any], int, int]:
        async with await equeue.aio.connect(url, timeout=20) as client:
            await client.ping()

            async def lane(n: int) -> list[Any]:
                return [await client.send("p", b"%d.%d" % (n, i)) for i in range(5)]

            async with asyncio.timeout(30):
                done = await asyncio.gather(*(lane(n) for n in range(30)))
            protocol = client._protocol
            assert protocol is not None
            return [r for results in done for r in results], protocol.free, len(protocol.pending)

    try:
        with BrokerThread(base / "store", max_in_flight=4) as broker:
            results, free, pending = asyncio.run(produce(broker.urls[0]))
            bodies = [broker.store.get(r.message_id).body for r in results]
            stats = broker.broker.handlers.stats()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert bodies == [b"%d.%d" % (n, i) for n in range(30) for i in range(5)]
    assert (free, pending) == (4, 0)
    assert stats["sends"] == 150 and stats["send_requests"] < 150  # coalesced
