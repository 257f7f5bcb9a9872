"""The asyncio client's direct send (a plain send alone on its connection: its frame made
in C and written at once, its answer read in C from the read buffer; aio.py
``_Protocol.direct``, equeue/cext/clientsend.c): the bytes and results are the general
path's, anything else falls back to it, and the outcomes (results, the broker's errors,
a broken connection, a cancelled caller) are those of any send."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from client_helpers import WELCOME, FakeBroker, Peer

import equeue.aio
from equeue import speedups
from equeue.client.core import DECODERS, AnswerReader, RequestEncoder
from equeue.errors import ConnectionLostError, InvalidMessageError, MessageTooLargeError
from equeue.protocol import plainsend
from equeue.protocol.frames import PROTOCOL_VERSION, encode
from equeue.protocol.handshake import LIMIT_CEILING, LIMIT_NAMES, OPTIONAL_LIMIT_NAMES
from equeue.protocol.records import pack_send_columns
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage, SendResult

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
RESULT: list[Any] = ["0123456789abcdef01234567", "t", 1, 2, 3, 1.5e9]
WELCOME_NOW = {**WELCOME, "version": PROTOCOL_VERSION}


@needs_c
@pytest.mark.parametrize("request_id", [1, 127, 128, 255, 256, 65536, 2**32 - 1, 2**32, 2**64 - 1])
@pytest.mark.parametrize("topic", ["t", "x" * 31, "x" * 32, "x" * 256, "é✓", "x" * 70000])
@pytest.mark.parametrize("size", [0, 100, 255, 256, 65535, 65536])
def test_the_c_frame_is_the_encoders(request_id: int, topic: str, size: int) -> None:
    body = b"b" * size
    encoder = RequestEncoder(1 << 20, "here", PROTOCOL_VERSION)
    expected = encoder.frame(request_id, "send", {"topic": topic, "body": body})
    assert plainsend.send_frame is not None
    assert plainsend.send_frame(request_id, topic, body, 1 << 20) == expected
    # past max_frame_bytes: the payload's size, which the encoder refuses
    limit = len(expected) - 5
    assert plainsend.send_frame(request_id, topic, body, limit) == len(expected) - 4
    with pytest.raises(MessageTooLargeError):
        RequestEncoder(limit, "here", PROTOCOL_VERSION).frame(
            request_id, "send", {"topic": topic, "body": body}
        )


@needs_c
@pytest.mark.parametrize(
    "arguments",
    [(0, "t", b""), (-1, "t", b""), (2**64, "t", b""), (True, "t", b""), (1, "\ud800", b""),
     (1, b"t", b""), (1, "t", bytearray(b"x")), (1, "t", "x")],
)  # fmt: skip
def test_the_c_frame_leaves_anything_else_to_the_encoder(arguments: tuple[Any, ...]) -> None:
    assert plainsend.send_frame is not None
    request_id, topic, body = arguments
    assert plainsend.send_frame(request_id, topic, body, 1 << 20) is None


def _general(frame: bytes, request_id: int) -> Any:
    """What AnswerReader and DECODERS["send"] make of the bytes for ``request_id``."""
    bodies = AnswerReader(1 << 20, "here").feed(frame)
    if len(bodies) != 1 or bodies[0][0] != request_id or bodies[0][1] != 0:
        return None
    return DECODERS["send"](bodies[0][2], "here")


def _frame(body: object) -> bytes:
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def _read(data: bytes, nbytes: int, request_id: int, limit: int = 1 << 20) -> Any:
    assert plainsend.send_result is not None
    buffer = bytearray(data) + b"\0" * 16  # (the read buffer is larger than a read)
    return plainsend.send_result(memoryview(buffer), nbytes, request_id, "t", limit)


@needs_c
@pytest.mark.parametrize("request_id", [1, 200, 70000, 2**40, 2**64 - 1])
@pytest.mark.parametrize(
    "result",
    [RESULT, ["é" * 24, "t", 0, 0, 0, 0.0], ["0" * 24, "other topic", 2**63, 2**64 - 1, 5, -1.5],
     ["", "t" * 300, 0, 1, 2, float("inf")]],
)  # fmt: skip
def test_the_c_answer_is_the_general_reads(request_id: int, result: list[Any]) -> None:
    frame = _frame([request_id, 0, result])
    found = _read(frame, len(frame), request_id)
    assert found == _general(frame, request_id) == SendResult(*result)
    assert type(found) is SendResult
    assert found.topic == result[1]


@needs_c
@pytest.mark.parametrize(
    "case",
    ["short", "two frames", "another id", "an error", "float32", "signed int", "not utf-8",
     "over the limit", "array16", "trailing byte"],
)  # fmt: skip
def test_the_c_answer_leaves_anything_else_to_the_general_read(case: str) -> None:
    frame = _frame([7, 0, RESULT])
    nbytes, request_id, limit = len(frame), 7, 1 << 20
    if case == "short":
        nbytes -= 1
    elif case == "two frames":
        frame += _frame([8, 0, RESULT])
        nbytes = len(frame)
    elif case == "another id":
        request_id = 8
    elif case == "an error":
        frame = _frame([7, 1, {"code": "TopicNotFoundError", "message": "m"}])
        nbytes = len(frame)
    elif case == "float32":  # msgpack reads it: the general path's result
        frame = frame[:-9] + b"\xca" + struct.pack(">f", 1.5)
        frame = struct.pack(">I", len(frame) - 4) + frame[4:]
        nbytes = len(frame)
        assert _general(frame, 7) == SendResult(*RESULT[:5], 1.5)  # type: ignore[call-arg]
    elif case == "signed int":  # queue id 1 as an int8: msgpack reads it
        frame = frame.replace(b"\x01\x02\x03", b"\xd0\x01\x02\x03")
        frame = struct.pack(">I", len(frame) - 4) + frame[4:]
        nbytes = len(frame)
        assert _general(frame, 7) == SendResult(*RESULT)
    elif case == "not utf-8":
        frame = frame.replace(b"0123", b"\xff123")
    elif case == "over the limit":
        limit = len(frame) - 5
    elif case == "array16":
        frame = struct.pack(">I", len(frame) - 2) + b"\xdc\x00\x03" + frame[5:]
        nbytes = len(frame)
        assert _general(frame, 7) == SendResult(*RESULT)
    elif case == "trailing byte":
        frame = struct.pack(">I", len(frame) - 3) + frame[4:] + b"\xc0"
        nbytes = len(frame)
    assert _read(frame, nbytes, request_id, limit) is None


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerThread]:
    base = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    try:
        with BrokerThread(base / "store", max_frame_bytes=64 * 1024) as thread:
            thread.store.create_topic("t", 4)
            yield thread
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_c
def test_sends_one_at_a_time_per_connection_are_read_in_c_and_stored(
    broker: BrokerThread,
) -> None:
    read = 0

    async def main() -> list[tuple[bytes, SendResult]]:
        nonlocal read
        clients = [await equeue.aio.connect(broker.urls[0]) for _ in range(8)]

        async def one(index: int, client: equeue.aio.AsyncClient) -> list[Any]:
            sent = []
            for n in range(25):
                body = f"{index}:{n}".encode()
                sent.append((body, await client.send("t", body)))
            return sent

        try:
            done = await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
            for client in clients:  # every place given back
                protocol = client._protocol
                assert protocol is not None and protocol.free == protocol.max_in_flight
                read += protocol.read_in_c
            return [pair for sent in done for pair in sent]
        finally:
            for client in clients:
                await client.close()

    sent = asyncio.run(main())
    assert read >= 150  # of 200: most answers whole in one read, by ClientConn
    for body, result in sent:
        stored = broker.store.get(result.message_id)
        assert stored.body == body
        assert (result.topic, result.queue_id, result.queue_offset, result.position) == (
            stored.topic, stored.queue_id, stored.queue_offset, stored.position
        )  # fmt: skip


def test_a_refused_direct_send_raises_the_brokers_error_and_the_client_goes_on(
    broker: BrokerThread,
) -> None:
    async def main() -> None:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            with pytest.raises(InvalidMessageError):  # the broker's answer: an error
                await client.send("bad topic", b"x")
            with pytest.raises(MessageTooLargeError):  # refused before it is written
                await client.send("t", b"x" * (64 * 1024))
            result = await client.send("t", b"after")
            assert broker.store.get(result.message_id).body == b"after"
            protocol = client._protocol
            assert protocol is not None and protocol.free == protocol.max_in_flight
        finally:
            await client.close()

    asyncio.run(main())


def _answer_script(answer: Any, gate: threading.Event | None = None) -> Any:
    """Welcome (this version), then to each request ``answer(peer, request_id)``."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send(WELCOME_NOW)
        while True:
            request_id = peer.recv()[0]
            if gate is not None:
                gate.wait(10)
            answer(peer, request_id)

    return script


def test_an_answer_in_two_reads_is_read_the_general_way() -> None:
    def answer(peer: Peer, request_id: int) -> None:
        frame = encode([request_id, 0, RESULT])
        peer.raw(frame[:7])
        threading.Event().wait(0.05)  # (two reads: the client sees the first part alone)
        peer.raw(frame[7:])

    async def main(url: str) -> list[SendResult]:
        client = await equeue.aio.connect(url)
        try:
            return [await client.send("t", b"x") for _ in range(3)]
        finally:
            await client.close()

    with FakeBroker(_answer_script(answer)) as fake:
        assert asyncio.run(main(fake.url)) == [SendResult(*RESULT)] * 3


def test_a_direct_send_whose_connection_breaks_is_reported_unanswered() -> None:
    def answer(peer: Peer, request_id: int) -> None:
        peer.raw(encode([request_id, 0, RESULT])[:-3])
        raise EOFError  # (the fake closes the connection)

    async def main(url: str) -> None:
        client = await equeue.aio.connect(url)
        try:
            with pytest.raises(ConnectionLostError) as raised:
                await client.send("t", b"lost")
            assert raised.value.unanswered == [OutgoingMessage(b"lost")]
        finally:
            await client.close()

    with FakeBroker(_answer_script(answer)) as fake:
        asyncio.run(main(fake.url))


def test_a_cancelled_direct_send_keeps_its_place_until_answered() -> None:
    gate = threading.Event()

    def answer(peer: Peer, request_id: int) -> None:
        peer.send([request_id, 0, [*RESULT[:2], request_id, 0, 0, 1.5]])

    async def main(url: str) -> None:
        client = await equeue.aio.connect(url)
        try:
            protocol = client._protocol
            assert protocol is not None
            task = asyncio.create_task(client.send("t", b"cancelled"))
            for _ in range(100):  # until it is written (and held: the gate)
                await asyncio.sleep(0.001)
                if protocol.pending:
                    break
            assert protocol.free == protocol.max_in_flight - 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert protocol.free == protocol.max_in_flight - 1  # the broker still holds it
            gate.set()
            result = await client.send("t", b"next")  # after the late answer, dropped
            assert result.queue_id == 2  # its own answer (request ids 1 and 2)
            assert protocol.free == protocol.max_in_flight and not protocol.pending
        finally:
            gate.set()
            await client.close()

    with FakeBroker(_answer_script(answer, gate)) as fake:
        asyncio.run(main(fake.url))


@needs_c
@pytest.mark.parametrize("limit", [2**63 - 1, 2**63, 2**64 - 1, 2**100])
def test_the_c_paths_take_a_limit_past_a_c_integer_as_no_limit(limit: int) -> None:
    # Not OverflowError (a builtin, reaching the client's caller): the 4-byte length
    # field stays the bound. A limit below 0 lets nothing through.
    assert speedups.SPEEDUPS is not None and plainsend.send_frame is not None
    frame = plainsend.send_frame(1, "t", b"x", limit)
    assert frame == plainsend.send_frame(1, "t", b"x", 1 << 20)
    assert type(frame) is bytes and _read(frame, len(frame), 1, limit) == _general(frame, 1)
    assert plainsend.send_frame(1, "t", b"x", -limit) == len(frame) - 4  # the size: too big
    assert _read(frame, len(frame), 1, -limit) is None
    bodies = speedups.SPEEDUPS.bodies_request
    assert bodies(1, "t", [b"x"], limit) == bodies(1, "t", [b"x"], 1 << 20)
    assert type(bodies(1, "t", [b"x"], -limit)) is int


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_welcome_with_limits_past_the_frame_length_is_held_to_it(loop: str) -> None:
    """A broker announcing max_frame_bytes (and the rest) of 2**63 or more: plain sends
    (direct, and sent together: send_bodies) are written and answered, no builtin
    OverflowError; the client holds every limit to the longest frame."""
    new_loop = asyncio.new_event_loop
    if loop == "uvloop":
        new_loop = pytest.importorskip("uvloop").new_event_loop
    huge = {name: 2**64 - 1 for name in (*LIMIT_NAMES, *OPTIONAL_LIMIT_NAMES)}
    welcome = {**WELCOME_NOW, "limits": {**huge, "max_frame_bytes": 2**63}}

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send(welcome)
        while True:
            request_id, op, arguments = peer.recv()
            if op == "send_bodies":  # (sends together: one request, made in C)
                results = [SendResult(*RESULT)] * len(arguments["bodies"])
                peer.send([request_id, 0, pack_send_columns("t", results)])
            else:
                peer.send([request_id, 0, RESULT])

    async def main(url: str) -> list[Any]:
        client = await equeue.aio.connect(url, timeout=5)
        try:
            alone = [await client.send("t", b"x") for _ in range(3)]
            together = await asyncio.gather(*(client.send("t", b"y") for _ in range(3)))
            found = client.welcome
            assert found is not None and set(found.limits.values()) == {LIMIT_CEILING}
            return [*alone, *together]
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        running = new_loop()
        try:
            assert running.run_until_complete(main(fake.url)) == [SendResult(*RESULT)] * 6
        finally:
            running.close()
        with equeue.connect(fake.url, timeout=5) as client:  # the blocking client too
            assert client.send("t", b"z") == SendResult(*RESULT)
