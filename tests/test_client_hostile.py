"""The clients against a broker that breaks the protocol (a scripted fake on a real Unix
socket): every failure is an equeue error (ProtocolError, ConnectionLostError, the
class an error answer names), never a builtin exception, and a send whose answer never
came is reported in ``unanswered``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer

import equeue
import equeue.aio
from equeue.errors import (
    AuthenticationError,
    BrokerError,
    ConnectionLostError,
    EQueueError,
    FrameTooLargeError,
    ProtocolError,
    TopicNotFoundError,
)
from equeue.protocol.frames import FRAME_HEADER, SUPPORTED_VERSIONS, encode

KINDS = ["sync", "aio"]
OPTIONS: dict[str, Any] = {"timeout": 2.0, "connect_timeout": 0.5}
SEND_RESULT = ["0" * 24, "t", 0, 0, 0, 1.5]


def call(kind: str, url: str, method: str, *args: Any, **options: Any) -> Any:
    """``method(*args)`` on a new client of ``url`` (connect's options merged in)."""
    settings = {**OPTIONS, **options}
    if kind == "sync":
        with equeue.connect(url, **settings) as client:
            return getattr(client, method)(*args)

    async def main() -> Any:
        client = await equeue.aio.connect(url, **settings)
        try:
            return await getattr(client, method)(*args)
        finally:
            await client.close()

    return asyncio.run(main())


def answer_with(reply: Any) -> Any:
    """A script: welcome, then to the first request ``reply(request_id)`` (bytes: raw)."""

    def script(peer: Peer) -> None:
        peer.welcome()
        request_id = peer.recv()[0]
        out = reply(request_id)
        if isinstance(out, bytes):
            peer.raw(out)
        else:
            peer.send(out)
        try:
            while True:
                peer.recv()
        except EOFError:
            pass

    return script


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_instead_of_a_welcome_is_a_protocol_error_not_retried(kind: str) -> None:
    def script(peer: Peer) -> None:
        peer.recv()
        peer.raw(FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1")  # 0xc1: never used in msgpack

    with FakeBroker(script) as fake, pytest.raises(ProtocolError, match="msgpack"):
        call(kind, fake.url, "ping")
    assert fake.connections == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_welcome_of_another_version_is_a_protocol_error(kind: str) -> None:
    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": 99})

    with FakeBroker(script) as fake, pytest.raises(ProtocolError, match="version 99"):
        call(kind, fake.url, "ping")


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_token_is_an_authentication_error_not_retried(kind: str) -> None:
    hellos: list[Any] = []

    def script(peer: Peer) -> None:
        hellos.append(peer.recv())
        peer.send([0, 1, {"code": "AuthenticationError", "message": "wrong token"}])

    with FakeBroker(script) as fake, pytest.raises(AuthenticationError, match="wrong token"):
        call(kind, fake.url, "ping", token="secret")
    assert fake.connections == 1
    assert hellos[0]["token"] == "secret" and hellos[0]["versions"] == list(SUPPORTED_VERSIONS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_closing_midway_through_the_welcome_is_connection_lost(kind: str) -> None:
    def script(peer: Peer) -> None:
        peer.recv()
        peer.raw(encode(WELCOME)[:9])  # truncated, then closed

    with FakeBroker(script) as fake, pytest.raises(ConnectionLostError, match="connect_timeout"):
        call(kind, fake.url, "ping")
    assert fake.connections >= 2  # retried: a broker restarting looks like this


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("reply", "cause"),
    [
        (lambda rid: FRAME_HEADER.pack(4) + b"\xc1abc", ProtocolError),  # not msgpack
        (lambda rid: FRAME_HEADER.pack(0xFFFFFFF0), FrameTooLargeError),  # huge length
        (lambda rid: FRAME_HEADER.pack(0), ProtocolError),  # an empty frame
        (lambda rid: encode([rid + 7, 0, SEND_RESULT]), ProtocolError),  # an unknown id
        (lambda rid: encode({"not": "an answer"}), ProtocolError),
        (lambda rid: encode([rid, 5, None]), ProtocolError),  # a status that is no status
        (lambda rid: encode([rid, 0, SEND_RESULT])[:-3], None),  # truncated, closed
        (lambda rid: encode([0, 1, {"code": "FrameTooLargeError", "message": "m"}]),
         FrameTooLargeError),  # the broker's connection error
    ],
)  # fmt: skip
def test_a_broken_answer_to_a_send_loses_the_connection_and_reports_the_send(
    kind: str, reply: Any, cause: type[BaseException] | None
) -> None:
    def script(peer: Peer) -> None:
        peer.welcome()
        request_id = peer.recv()[0]
        peer.raw(reply(request_id))
        # (then the fake closes: the truncated case ends that way)

    with FakeBroker(script) as fake, pytest.raises(ConnectionLostError) as raised:
        call(kind, fake.url, "send", "t", b"body")
    if cause is not None:
        assert isinstance(raised.value.__cause__, cause)
    assert [m.body for m in raised.value.unanswered] == [b"body"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_that_never_answers_is_connection_lost_after_the_timeout(kind: str) -> None:
    def script(peer: Peer) -> None:
        peer.welcome()
        while True:  # reads, never answers, until the client closes
            peer.recv()

    with (
        FakeBroker(script) as fake,
        pytest.raises(ConnectionLostError, match=r"timeout=0\.3s") as raised,
    ):
        call(kind, fake.url, "send", "t", b"x", timeout=0.3)
    assert [m.body for m in raised.value.unanswered] == [b"x"]


@pytest.mark.parametrize("kind", KINDS)
def test_error_answers_raise_the_class_they_name(kind: str) -> None:
    error = {"code": "TopicNotFoundError", "message": "no topic 't'"}
    with (
        FakeBroker(answer_with(lambda rid: [rid, 1, error])) as fake,
        pytest.raises(TopicNotFoundError, match="no topic 't'"),
    ):
        call(kind, fake.url, "queue_ids", "t")
    unknown = {"code": "NoSuchError", "message": "what"}
    with (
        FakeBroker(answer_with(lambda rid: [rid, 1, unknown])) as fake,
        pytest.raises(BrokerError, match="NoSuchError: what"),
    ):
        call(kind, fake.url, "topics")
    with (
        FakeBroker(answer_with(lambda rid: [rid, 1, "not a map"])) as fake,
        pytest.raises(ProtocolError, match="error answer"),
    ):
        call(kind, fake.url, "topics")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("method", "args", "result"),
    [
        ("send", ("t", b"x"), ["id", "t", 0, 0, 0, "not a float"]),
        ("send", ("t", b"x"), [1, 2, 3]),
        ("pull", ("t", 0, 0), [[["m"]], 0]),
        ("pull", ("t", 0, 0), [[], -1]),
        ("topics", (), ["a", 3]),
        ("queue_range", ("t", 0), [1]),
        ("get", ("0" * 24,), {"a": 1}),
        ("stats", (), [1, 2]),
    ],
)
def test_a_result_of_the_wrong_shape_is_a_protocol_error(
    kind: str, method: str, args: tuple[Any, ...], result: Any
) -> None:
    with (
        FakeBroker(answer_with(lambda rid: [rid, 0, result])) as fake,
        pytest.raises(ProtocolError),
    ):
        call(kind, fake.url, method, *args)


def test_no_builtin_exception_escapes_random_answers() -> None:
    """Random bytes as the answer to each of a run of requests, with a fixed seed."""
    import random

    rng = random.Random(23)
    replies = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(40)]
    replies += [FRAME_HEADER.pack(len(r)) + r for r in replies[:20]]  # well framed garbage

    def script(peer: Peer) -> None:
        peer.welcome()
        peer.recv()
        peer.raw(replies[fake.connections - 1])

    started = time.monotonic()
    with FakeBroker(script) as fake:
        for _ in replies:
            with pytest.raises(EQueueError):
                call("sync", fake.url, "topics", timeout=0.5)
            assert time.monotonic() - started < 60


@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_that_never_welcomes_is_connection_lost_after_connect_timeout(
    kind: str,
) -> None:
    def script(peer: Peer) -> None:
        peer.recv()  # the hello; then silence until the client gives up
        while True:
            peer.recv()

    with FakeBroker(script) as fake, pytest.raises(ConnectionLostError, match=fake.url):
        call(kind, fake.url, "ping", connect_timeout=0.3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_that_stops_reading_is_connection_lost_after_the_timeout(kind: str) -> None:
    """A send larger than the socket buffers to a broker that never reads: the write
    blocks (sync) or the answer never comes (aio); after ``timeout`` the connection is
    closed and the send is reported unanswered."""
    release = threading.Event()

    def script(peer: Peer) -> None:
        peer.welcome()
        release.wait(30)  # reads nothing more

    with FakeBroker(script) as fake:
        try:
            with pytest.raises(ConnectionLostError) as raised:
                call(kind, fake.url, "send", "t", b"x" * (4 << 20), timeout=0.5)
        finally:
            release.set()
    assert [len(m.body) for m in raised.value.unanswered] == [4 << 20]


def test_a_held_pull_outlives_the_kernel_timeout_of_a_direct_read() -> None:
    # The sync reader blocks in recv under SO_RCVTIMEO (the client's timeout, 0.3 s); a
    # pull held by the broker for its wait_ms may take longer: that EAGAIN is no expiry.
    def script(peer: Peer) -> None:
        peer.welcome()
        request_id = peer.recv()[0]
        time.sleep(0.6)
        peer.send([request_id, 0, {"held": True}])
        with contextlib.suppress(OSError, EOFError):
            peer.recv()

    with FakeBroker(script) as fake, equeue.connect(fake.url, timeout=0.3) as client:
        arguments = {"topic": "t", "queue_id": 0, "offset": 0, "max_count": 1, "wait_ms": 900}
        assert client.request("pull", arguments) == {"held": True}
