"""The broker's plain-send fast path (cext/sendframe.c, Connection.buffer_updated and
_request) against the general path: the same reads give the same answers and the same
store, and a hostile frame through it closes only its own connection.

The reads are fed to Connection.buffer_updated as asyncio would after a socket read,
through a transport that records what is written, so each example decides exactly where
the reads split (a real socket may merge them); the hostile frames go over real sockets."""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import random
import shutil
from pathlib import Path
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir

from equeue import speedups
from equeue.errors import StoreWriteError
from equeue.protocol.frames import (
    FRAME_HEADER,
    STATUS_ERROR,
    STATUS_OK,
    FrameReader,
    check_request,
    encode,
)
from equeue.protocol.handshake import Hello
from equeue.server import BrokerThread
from equeue.server.config import ServerConfig
from equeue.server.connection import Connection, release_durable
from equeue.server.handlers import Frame
from equeue.server.serve import Broker

Flush = Literal["sync", "async"]
UNPACK = msgpack.unpackb  # the answers' decoder, not counted by the test that counts
pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the fast path is C")


class Recorder:
    """A transport that keeps what is written; closing ends the connection."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.protocol: Connection | None = None
        self.closing = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        if not self.closing and self.protocol is not None:
            self.closing = True
            self.protocol.connection_lost(None)

    abort = close

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0  # never full: no backpressure here

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def __getattr__(self, name: str) -> Any:
        # set_write_buffer_limits, pause_reading, resume_reading: nothing to do
        return lambda *args, **kwargs: None


def _feed(connection: Connection, read: bytes) -> None:
    view = connection.get_buffer(len(read))
    view[: len(read)] = read
    connection.buffer_updated(len(read))


def _normal(answer: list[Any]) -> list[Any]:
    """An answer without what differs between two stores: the store id in a message id,
    the stored time."""
    rid, status, payload = answer
    if status == 0 and type(payload) is list and len(payload) == 6:
        payload = [payload[0][8:], *payload[1:5]]
    return [rid, status, payload]


def _connect(broker: Broker) -> tuple[Connection, Recorder]:
    transport = Recorder()
    connection = Connection(broker, "test", 1)
    transport.protocol = connection
    connection.connection_made(transport)  # type: ignore[arg-type]
    return connection, transport


async def _serve(directory: Path, reads: list[bytes], fast: bool, flush: Flush) -> tuple[Any, ...]:
    broker = Broker(directory, ServerConfig(flush=flush))
    await broker.start()
    try:
        connection, transport = _connect(broker)
        if not fast:
            connection._plain_send = connection._send_body = None
        _feed(connection, encode(Hello(client="t").pack()))
        for read in reads:
            if connection.closed:
                break
            _feed(connection, read)
            if broker.commit is not None:
                await broker.commit.drain()
            await asyncio.sleep(0)  # answers written in a callback
        _welcome, *frames = FrameReader(1 << 30, "t").feed(bytes(transport.data))
        answers = [_normal(UNPACK(b)) for b in frames]
        store = broker.store
        stored = []
        for topic in sorted(store.topics()):
            for queue_id in store.queue_ids(topic):
                found = store.pull(topic, queue_id, 0, 10_000)
                stored += [(topic, queue_id, m.queue_offset, m.body, m.tag) for m in found.messages]
        counters = broker.counters
        return answers, stored, counters.totals()[:3], counters.errors, connection.closed
    finally:
        await broker._drain()


PLAIN_TOPICS = ["t", "topic-ü", "equeue.retry.x", "", "a/b", "x" * 300]
REQUEST_IDS = st.one_of(st.integers(1, 300), st.integers(1, (1 << 64) - 1), st.just(0))


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    rid = draw(REQUEST_IDS)
    topic = draw(st.sampled_from(PLAIN_TOPICS))
    body = draw(st.binary(max_size=300))
    if kind <= 5:  # a plain send, either key order
        args = {"topic": topic, "body": body} if kind % 2 else {"body": body, "topic": topic}
        return encode([rid, "send", args])
    if kind == 6:
        return encode([rid, "send", {"topic": topic, "body": body, "tag": "a"}])
    if kind == 7:
        return encode([rid, "ping", {}])
    if kind == 8:  # a plain send's bytes, damaged
        frame = bytearray(encode([rid, "send", {"topic": topic, "body": body}]))
        at = draw(st.integers(4, len(frame) - 1))
        frame[at] = draw(st.integers(0, 255))
        return bytes(frame)
    return encode([rid, "send", {"topic": topic, "body": "text"}])  # a wrong type: fatal


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    """The frames' bytes split into reads: at frame boundaries (a read that is one frame,
    the fast path's) and at random points."""
    parts = draw(st.lists(frames(), min_size=1, max_size=12))
    data = b"".join(parts)
    cuts: set[int] = set()
    end = 0
    for part in parts:
        end += len(part)
        if draw(st.booleans()):
            cuts.add(end)
    cuts |= set(draw(st.lists(st.integers(1, len(data) - 1), max_size=4)))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=streams(), flush=st.sampled_from(["async", "sync"]))
def test_the_fast_path_answers_and_stores_as_the_general_path(
    reads: list[bytes], flush: Flush
) -> None:
    directory = short_dir()
    try:
        fast = asyncio.run(_serve(directory / "fast", reads, True, flush))
        general = asyncio.run(_serve(directory / "general", reads, False, flush))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert fast == general


def test_a_one_frame_read_takes_the_fast_path() -> None:
    """The control of the test above: the fast path is taken at all (send_plain's frame
    written directly, no general decoding)."""
    directory = short_dir()
    calls: list[bytes] = []
    real = msgpack.unpackb

    def counting(data: bytes, **kwargs: Any) -> Any:
        calls.append(bytes(data))
        return real(data, **kwargs)

    read = encode([5, "send", {"topic": "t", "body": b"x"}])
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(msgpack, "unpackb", counting)
            fast = asyncio.run(_serve(directory / "fast", [read], True, "async"))
            decoded_fast = len(calls)
            asyncio.run(_serve(directory / "general", [read], False, "async"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert fast[0][0][:2] == [5, 0] and fast[1] == [("t", 0, 0, b"x", "")]
    assert decoded_fast == 1  # the hello only
    assert len(calls) == 3  # the general path: its hello and the send; (the fast one's hello)


def test_hostile_plain_send_frames_close_only_their_connection() -> None:
    """Damaged plain-send frames, each a whole read on a real socket: each is answered
    or closes its connection, and a client on another connection is served throughout."""
    rng = random.Random(2330)
    directory = short_dir()
    running = BrokerThread(directory / "s", flush="sync")
    try:
        with running, raw(running.urls[0]) as good:
            outcomes = {"answered": 0, "closed": 0}
            for case in range(150):
                frame = bytearray(encode([case + 1, "send", {"topic": "fz", "body": b"b" * 40}]))
                for _ in range(rng.randint(1, 3)):
                    frame[rng.randrange(4, len(frame))] = rng.randrange(256)
                if rng.random() < 0.2:  # the length field too (empty, too large)
                    FRAME_HEADER.pack_into(frame, 0, rng.choice([0, 1 << 31]))
                with raw(running.urls[0]) as c:
                    c.send_raw(bytes(frame))
                    c.sock.settimeout(5)
                    try:
                        c.request("ping")
                        rid = c.recv()[0]
                        outcomes["answered" if rid != 0 else "closed"] += 1
                    except TimeoutError:
                        raise AssertionError(f"no answer, not closed: {bytes(frame)!r}") from None
                    except OSError:  # ConnectionError too: closed (after an error answer)
                        outcomes["closed"] += 1
                assert good.call("ping") is None
            sent = good.call("send", topic="ok", body=b"y")
            assert sent[1] == "ok"
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert outcomes["answered"] and outcomes["closed"], outcomes


@pytest.mark.parametrize("rid", [1, 2**63 - 1, 2**63, 2**64 - 1])
def test_the_c_parsers_take_every_request_id_the_general_path_takes(rid: int) -> None:
    """The broker's plain-send reader and the client's send_bodies answer reader both take
    ids up to 2**64-1, as check_request does (the answer reader stopped at 2**63-1); the
    answers written in C carry frames.STATUS_OK (msgpack_min.h's MP_STATUS_OK)."""
    fast = speedups.SPEEDUPS
    assert fast is not None
    request = msgpack.packb([rid, "send", {"topic": "t", "body": b"x"}])
    assert check_request(msgpack.unpackb(request), "here")[0] == rid
    assert fast.send_body(request) == (rid, "t", b"x")
    value = ["t", ["0bffcd16" + "0" * 16], [0], [0], [0], [1.5]]
    read = fast.columns_answer(msgpack.packb([rid, STATUS_OK, value]), {rid})
    assert read is not None and read[:2] == [rid, STATUS_OK]
    assert fast.columns_answer(msgpack.packb([rid, STATUS_ERROR, value]), {rid}) is None
    result = ("t", "0bffcd16" + "0" * 16, 1, 2, 3, 1.5)
    answer = fast.send_answer(rid, result)
    assert answer == encode([rid, STATUS_OK, list(result)])
    assert msgpack.unpackb(answer[FRAME_HEADER.size :])[1] == STATUS_OK


async def _release(directory: Path) -> tuple[list[Any], int]:
    """Deferred answers released as a group commit releases them: a result that is
    bytes, a Frame, and a Frame whose flush failed; the answers decoded, and in_flight."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        connection, transport = _connect(broker)
        _feed(connection, encode(Hello(client="t").pack()))
        connection.in_flight += 3
        release_durable(
            [(connection, 5, b"a body"), (connection, 6, Frame(encode([6, 0, "x"])))], None
        )
        failed = StoreWriteError(5, "fdatasync failed (EIO)")
        release_durable([(connection, 7, Frame(encode([7, 0, "y"])))], failed)
        _welcome, *frames = FrameReader(1 << 30, "t").feed(bytes(transport.data))
        return [UNPACK(b) for b in frames], connection.in_flight
    finally:
        await broker._drain()


def test_only_a_frame_is_queued_raw_and_release_durable_finishes_each_answer() -> None:
    """A deferred result that is bytes is an answer's value (msgpack bin), not a frame
    (it was written raw, desynchronizing the client); a Frame is written as it is; a
    failed flush answers its request id with the error."""
    directory = short_dir()
    try:
        answers, in_flight = asyncio.run(_release(directory / "s"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert answers[:2] == [[5, STATUS_OK, b"a body"], [6, STATUS_OK, "x"]]
    assert answers[2][:2] == [7, STATUS_ERROR] and "EIO" in answers[2][2]["message"]
    assert (len(answers), in_flight) == (3, 0)


class CountingRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        assert type(data) is bytes  # uvloop takes anything else through a memoryview cast
        super().write(data)


def _answers(transport: Recorder) -> list[Any]:
    return [UNPACK(b) for b in FrameReader(1 << 30, "t").feed(bytes(transport.data))]


def _greeted(broker: Broker, count: int) -> list[tuple[Connection, CountingRecorder]]:
    """count connections past their hello, their transports' records cleared."""
    peers = []
    for _ in range(count):
        transport = CountingRecorder()
        connection = Connection(broker, "test", 1)
        transport.protocol = connection
        connection.connection_made(transport)  # type: ignore[arg-type]
        _feed(connection, encode(Hello(client="t").pack()))
        transport.data.clear()  # the welcome
        transport.writes = 0
        peers.append((connection, transport))
    return peers


async def _grouped(directory: Path) -> dict[str, Any]:
    """One flushed batch of plain sends' Frames for four connections: one with two answers
    (apart in the batch), one with one, one closed, one half-closed by its client."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        peers = _greeted(broker, 4)
        (one, _), (two, _), (gone, gone_t), (ended, _) = peers
        one.in_flight, two.in_flight, gone.in_flight, ended.in_flight = 2, 1, 1, 1
        gone_t.close()
        assert ended.eof_received() is True  # waits for its answer
        frame = {rid: Frame(encode([rid, STATUS_OK, f"r{rid}"])) for rid in range(1, 6)}
        batch = [(one, 1, frame[1]), (two, 2, frame[2]), (one, 3, frame[3])]
        batch += [(gone, 4, frame[4]), (ended, 5, frame[5])]
        fast = speedups.SPEEDUPS
        assert fast is not None
        grouped = fast.frames_by_peer(batch, Frame)
        connections = [c for c, _ in peers]
        welcomes = broker.counters.bytes_out
        release_durable(batch, None)  # type: ignore[arg-type]
        return {
            "grouped": [(connections.index(c), d, n) for c, d, n in grouped],
            "answers": [_answers(t) for _, t in peers],
            "writes": [t.writes for _, t in peers],
            "in_flight": [c.in_flight for c, _ in peers],
            "ended_closed": ended.closed,
            "bytes_out": broker.counters.bytes_out - welcomes,
            "sizes": sum(len(frame[r]) for r in (1, 2, 3, 5)),
        }
    finally:
        await broker._drain()


def test_release_durable_writes_each_connections_frames_joined_in_order_once() -> None:
    """A flushed batch of Frames alone goes by connection (cext/release.c): a connection's
    answers in batch order in one write of exact bytes, a closed connection's dropped (its
    in_flight still counted down), a half-closed client closed after its last answer."""
    directory = short_dir()
    try:
        seen = asyncio.run(_grouped(directory / "s"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert [(i, n) for i, _, n in seen["grouped"]] == [(0, 2), (1, 1), (2, 1), (3, 1)]
    assert all(type(d) is bytes for _, d, _ in seen["grouped"])
    assert seen["answers"] == [
        [[1, STATUS_OK, "r1"], [3, STATUS_OK, "r3"]],
        [[2, STATUS_OK, "r2"]],
        [],
        [[5, STATUS_OK, "r5"]],
    ]
    assert seen["writes"] == [1, 1, 0, 1]
    assert seen["in_flight"] == [0, 0, 0, 0]
    assert seen["ended_closed"] is True
    assert seen["bytes_out"] == seen["sizes"]


def test_frames_by_peer_leaves_any_other_batch_to_the_answer_by_answer_path() -> None:
    fast = speedups.SPEEDUPS
    assert fast is not None
    peer = object()
    framed = Frame(b"\x00\x00\x00\x01\xc0")
    assert fast.frames_by_peer([], Frame) == []
    assert fast.frames_by_peer([(peer, 1, framed), (peer, 2, b"a body")], Frame) is None
    assert fast.frames_by_peer([(peer, 1, framed, 0)], Frame) is None
    assert fast.frames_by_peer([[peer, 1, framed]], Frame) is None
    with pytest.raises(TypeError):
        fast.frames_by_peer((peer, 1, framed), Frame)
    unhashable: list[Any] = []
    with pytest.raises(TypeError):
        fast.frames_by_peer([(unhashable, 1, framed)], Frame)


@pytest.mark.parametrize("failure", [MemoryError, RuntimeError])
def test_a_grouping_that_fails_leaves_the_batch_to_the_answer_by_answer_path(
    monkeypatch: pytest.MonkeyPatch, failure: type[Exception]
) -> None:
    """release_frames' grouping raising (no memory; release.c's "the batch changed") lost
    every answer of the flushed batch, and their connections' in_flight stayed counted."""
    import equeue.server.release as release_module

    def fails(*args: object) -> None:
        raise failure("release_frames failed")

    monkeypatch.setattr(release_module, "release_frames", fails)
    directory = short_dir()
    try:
        seen = asyncio.run(_grouped(directory / "s"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert seen["answers"] == [
        [[1, STATUS_OK, "r1"], [3, STATUS_OK, "r3"]],
        [[2, STATUS_OK, "r2"]],
        [],
        [[5, STATUS_OK, "r5"]],
    ]
    assert seen["writes"] == [1, 1, 0, 1]  # exact bytes each (CountingRecorder)
    assert seen["in_flight"] == [0, 0, 0, 0]
    assert seen["ended_closed"] is True
    assert seen["bytes_out"] == seen["sizes"]


async def _mixed(directory: Path) -> tuple[list[list[Any]], list[int], list[int]]:
    """A flushed batch of a Frame and a deferred value (a send_bodies' result): answer by
    answer (finish, _write_out), each connection with one answer."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        peers = _greeted(broker, 2)
        for connection, _ in peers:
            connection.in_flight = 1
        (one, _), (two, _) = peers
        batch = [(one, 1, Frame(encode([1, STATUS_OK, "r1"]))), (two, 2, "r2")]
        release_durable(batch, None)  # type: ignore[arg-type]
        return (
            [_answers(t) for _, t in peers],
            [t.writes for _, t in peers],
            [c.in_flight for c, _ in peers],
        )
    finally:
        await broker._drain()


def test_a_lone_frame_answered_by_finish_is_written_as_exact_bytes() -> None:
    directory = short_dir()
    try:
        answers, writes, in_flight = asyncio.run(_mixed(directory / "s"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert answers == [[[1, STATUS_OK, "r1"]], [[2, STATUS_OK, "r2"]]]
    assert writes == [1, 1]  # exact bytes each (CountingRecorder)
    assert in_flight == [0, 0]


class _NoMemory(bytes):
    __slots__ = ()


def _allocation_fails(kind: type) -> None:
    """kind's tp_alloc made PyErr_NoMemory (it takes no arguments, ignores the two it gets:
    a NULL with MemoryError), found in the type object by its current value."""
    address = ctypes.cast(ctypes.pythonapi.PyType_GenericAlloc, ctypes.c_void_p).value
    size: int = type.__basicsize__  # type: ignore[assignment]  # (typeshed: a method)
    slots = (ctypes.c_void_p * (size // 8)).from_address(id(kind))
    found = [i for i, value in enumerate(slots) if value == address]
    assert len(found) == 1
    slots[found[0]] = ctypes.cast(ctypes.pythonapi.PyErr_NoMemory, ctypes.c_void_p).value


def test_a_plain_send_whose_answer_cannot_be_packed_is_still_answered() -> None:
    """The answer's allocation failing after the append (no memory): the result with no
    frame, for the caller to pack (connection.py's `frame is None`), not an exception
    that closed the connection with the message stored and unanswered."""
    fast = speedups.SPEEDUPS
    assert fast is not None
    _allocation_fails(_NoMemory)
    with pytest.raises(MemoryError):
        _NoMemory(b"x")  # the injection works
    result = ("t", "00000000000000000000000000000001", 0, 5, 64, 1.5)
    assert type(fast.send_answer(9, result)) is bytes  # bytes are made as they were
    sent: list[tuple[str, bytes]] = []

    def send(topic: str, body: bytes) -> tuple[Any, ...]:
        sent.append((topic, body))
        return result

    frame = encode([9, "send", {"topic": "t", "body": b"a body"}])
    buffer = bytearray(frame)
    got = fast.plain_send(buffer, len(frame), 1 << 20, send, _NoMemory, "equeue.")
    assert got == (9, result, None)
    assert sent == [("t", b"a body")]
