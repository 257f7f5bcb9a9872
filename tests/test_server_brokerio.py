"""Answers sent to the connection's socket by C (cext/answerwrite.c, server/direct.py):
in order with the answers that go through the transport, never to a closed or reused
socket, never over TLS. (A SIGKILL under 64 connections, their answers sent this way:
tests/test_server_kill_cadd.py.)

The brokers run ``--flush sync`` (the answers release_frames writes after an fdatasync;
one test also ``--flush async``: the send lane's), on uvloop and on asyncio's own loop."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, raw, short_home
from test_server_auth import _self_signed

import equeue.aio
from equeue import speedups
from equeue.protocol.frames import FrameReader, check_answer, decode_body, encode
from equeue.server import BrokerThread
from equeue.server.direct import direct_fd

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="needs the C accelerator")

home = pytest.fixture(short_home, name="home")
LOOPS = ["uvloop", "asyncio"]
LIMIT_S = 60.0
ROUNDS = 5  # of a pull and a send
PULLS = 10  # answers of 4 x 60 kB each: 2.4 MB queued, below write_buffer_high (4 MiB)


def direct_count() -> int:
    assert speedups.SPEEDUPS is not None
    return int(speedups.SPEEDUPS.answers_written_directly())


async def durable_sends(url: str, clients: int, each: int, tag: str) -> list[str]:
    """``clients`` aio connections, one send in flight each: the acknowledged bodies."""
    acked: list[str] = []

    async def lane(number: int) -> None:
        client = await equeue.aio.connect(url)
        try:
            for i in range(each):
                body = f"{tag}{number}:{i}"
                result = await client.send("t", body.encode())
                assert result.topic == "t"
                acked.append(body)
        finally:
            await client.close()

    await asyncio.wait_for(asyncio.gather(*(lane(n) for n in range(clients))), LIMIT_S)
    return acked


def slowly(c: Raw, count: int, most: int = 1 << 40) -> list[tuple[int, int, Any]]:
    """``count`` answers (or what came in ``most`` bytes) read 8 KiB at a time with a pause
    between reads (a slow reader: the broker's writes queue in its transport while the
    socket drains)."""
    got: list[tuple[int, int, Any]] = []
    for _ in range(100_000):  # bounded
        if (count and len(got) >= count) or most <= 0:
            return got
        most -= 8192
        data = c.sock.recv(8192)  # (8192 at most: the last part may be a frame's head)
        if not data:
            raise ConnectionError("the broker closed the connection")
        got += [check_answer(decode_body(b, "test"), "test") for b in c.reader.feed(data)]
        time.sleep(0.0002)
    raise AssertionError(f"{len(got)} of {count} answers")


def bodies_in(store: Any, topic: str = "t") -> set[bytes]:
    found: set[bytes] = set()
    for queue_id in store.queue_ids(topic):
        offset = 0
        for _ in range(10_000):  # bounded: 1,000 a pull
            got = store.pull(topic, queue_id, offset, 1000)
            if not got.messages:
                break
            found.update(m.body for m in got.messages)
            offset = got.next_offset
    return found


@pytest.mark.parametrize("flush", ["sync", "async"])
@pytest.mark.parametrize("loop", LOOPS)
def test_an_answer_behind_a_full_socket_waits_its_turn(home: Path, loop: str, flush: str) -> None:
    """A client that does not read has ~2.4 MB of pull answers queued in its transport (its
    socket full) when its durable send's answer is released: that answer goes after them,
    through the transport, whole; meanwhile other connections are answered directly. Sent
    to the socket at once (no check of the transport's buffer), it would land inside a
    pull answer and the stalled client's frames would not parse. Under ``--flush async``
    the answers sent directly are the send lane's (cext/sendlane.c), at once."""
    with BrokerThread(home / "s", flush=flush, event_loop=loop) as running:
        url = running.urls[0]
        big = b"x" * 60_000
        with raw(url) as setup:
            setup.call("create_topic", topic="big", queue_count=1)
            for _ in range(4):
                setup.call("send", topic="big", body=big, queue_id=0)
        before = direct_count()
        stalled = Raw(url)
        try:
            # a small receive buffer: the broker's writes back up into its transport
            stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            requests = [encode([rid, "pull", {"topic": "big", "queue_id": 0, "offset": 0}])
                        for rid in range(1, PULLS + 1)]  # fmt: skip
            requests.append(encode([PULLS + 1, "send", {"topic": "t", "body": b"stalled"}]))
            stalled.send_raw(b"".join(requests))
            # others keep being answered while it reads nothing
            acked = asyncio.run(durable_sends(url, 8, 25, "o"))
            assert len(acked) == 200
            queued = [c.transport.get_write_buffer_size() for c in running.broker.connections
                      if c.transport is not None]  # fmt: skip
            assert max(queued) > 100_000, queued  # the stalled one's answers wait there
            # read everything: every frame whole, in request order, the send's last
            got = [check_answer(stalled.recv(), "test") for _ in range(PULLS + 1)]
        finally:
            stalled.close()
        assert [rid for rid, _, _ in got] == list(range(1, PULLS + 2))
        assert all(status == 0 for _, status, _ in got), got[-1]
        assert all(len(payload[0]) == 4 for _, _, payload in got[:PULLS])  # [messages, next]
        assert got[-1][2][1] == "t"  # the send's SendResult
        assert direct_count() - before >= 150  # the others' answers went the direct way
        assert b"stalled" in bodies_in(running.store)
        # Then rounds of a pull whose answer is begun to be read before a send follows:
        # the send's answer is released while the socket has room again (a Unix socket
        # polls writable only below a quarter full, so the transport does not refill it
        # yet) and the rest of the pull's answer still waits in the transport.
        with raw(url) as reader:
            assert reader.call("ping") is None
            connection = max(running.broker.connections, key=lambda c: c.number)
            for r in range(ROUNDS):
                pull = {"topic": "big", "queue_id": 0, "offset": 0}
                reader.send_raw(encode([2 * r + 1, "pull", pull]))
                got = slowly(reader, 0, 64 * 1024)
                sends = running.broker.counters.sends
                reader.send_raw(encode([2 * r + 2, "send", {"topic": "t", "body": b"r%d" % r}]))
                for _ in range(5000):  # until its answer was released (5 s at most)
                    if running.broker.counters.sends > sends and not connection.in_flight:
                        break
                    time.sleep(0.001)
                transport = connection.transport  # the pull's rest waits there
                assert transport is not None and transport.get_write_buffer_size() > 0
                (rid, status, payload), (rid2, status2, payload2) = got + slowly(reader, 2)
                assert (rid, status, len(payload[0])) == (2 * r + 1, 0, 4)
                assert (rid2, status2, payload2[1]) == (2 * r + 2, 0, "t")


@pytest.mark.parametrize("loop", LOOPS)
def test_connections_closing_with_answers_pending(home: Path, loop: str) -> None:
    """Connections that pipeline durable sends and close at once, over and over (their fds
    freed and reused by the next; a third reset, an answer unread; a third closed by the
    broker for a bad frame after its sends), while steady connections send and check that
    each answer carries one of their own request ids, and each new connection that its
    first answer is its hello's: no answer reaches another connection (with the closing,
    closed and fd guards removed, a new connection got another's answer as its welcome),
    every acknowledged send is stored, every churned send too (appended before its
    fdatasync; only its answer had nowhere to go)."""
    with BrokerThread(home / "s", flush="sync", event_loop=loop) as running:
        url = running.urls[0]
        steady_count, rounds = 6, 120
        stop = time.monotonic() + LIMIT_S

        async def steady(number: int, done: asyncio.Event) -> list[bytes]:
            sent: list[bytes] = []
            c = await asyncio.to_thread(Raw, url)
            base = (number + 1) * 1_000_000
            try:
                for i in range(100_000):  # bounded; ends once the churn is done
                    if (done.is_set() and i >= 20) or time.monotonic() > stop:
                        break
                    body = b"s%d:%d" % (number, i)
                    c.sock.sendall(encode([base + i, "send", {"topic": "t", "body": body}]))
                    rid, status, _ = await asyncio.to_thread(lambda: check_answer(c.recv(), ""))
                    assert (rid, status) == (base + i, 0), (number, i, rid, status)
                    sent.append(body)
            finally:
                c.close()
            return sent

        def churn() -> list[bytes]:
            sent: list[bytes] = []
            for r in range(rounds):
                c = Raw(url)
                frames = []
                if r % 3 == 1:  # a ping's answer left unread: the close is a reset
                    frames.append(encode([6_000_000, "ping", {}]))
                for i in range(4):
                    body = b"c%d:%d" % (r, i)
                    frames.append(encode([7_000_000 + i, "send", {"topic": "t", "body": body}]))
                    sent.append(body)
                if r % 3 == 2:  # the broker closes it (a bad frame) with sends pending
                    frames.append(b"\x00\x00\x00\x01\xc1")
                c.send_raw(b"".join(frames))
                assert isinstance(c.welcome, dict), c.welcome  # its own hello's answer
                if r % 3 == 0:  # one answer read (its own), three still pending
                    rid, _, _ = check_answer(c.recv(), "test")
                    assert 7_000_000 <= rid < 7_000_004, rid
                elif r % 3 == 1:
                    time.sleep(0.001)  # (the ping answered before the close)
                c.close()
            return sent

        async def run() -> tuple[list[bytes], list[list[bytes]]]:
            done = asyncio.Event()
            steadies = [asyncio.create_task(steady(n, done)) for n in range(steady_count)]
            churned = await asyncio.to_thread(churn)
            done.set()
            return churned, await asyncio.gather(*steadies)

        before = direct_count()
        churned, steadies = asyncio.run(run())
        assert direct_count() > before
        found = bodies_in(running.store)
        for sent in steadies:
            assert len(sent) >= 20
            assert not [b for b in sent if b not in found]
        assert not [b for b in churned if b not in found]
        with raw(url) as c:
            assert c.call("ping") is None  # the broker lives on


@pytest.mark.parametrize("loop", LOOPS)
def test_tls_answers_go_through_the_transport(home: Path, loop: str) -> None:
    """Over TLS the socket carries records, not frames: no connection gets an fd to send
    on, and durable answers arrive decrypted and whole."""
    cert, key = _self_signed(home)
    with BrokerThread(
        home / "s", listen=["tls://127.0.0.1:0", "unix:" + str(home / "u.sock")],
        tls_cert=str(cert), tls_key=str(key), flush="sync", event_loop=loop,
    ) as running:  # fmt: skip
        tls_url, unix_url = running.urls
        port = int(tls_url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=str(cert))
        with (
            socket.create_connection(("127.0.0.1", port), 20) as plain,
            context.wrap_socket(plain, server_hostname="localhost") as sock,
            raw(unix_url) as local,
        ):
            reader = FrameReader(1 << 20, "test")

            def recv() -> Any:
                for _ in range(1000):
                    bodies = reader.feed(sock.recv(1 << 16))
                    if bodies:
                        return decode_body(bodies[0], "test")
                raise AssertionError("no answer")

            sock.sendall(encode({"versions": [1], "client": "tls"}))
            assert recv()["version"] == 1
            for rid in range(1, 6):
                sock.sendall(encode([rid, "send", {"topic": "t", "body": b"over tls"}]))
                got_id, status, result = check_answer(recv(), "test")
                assert (got_id, status, result[1]) == (rid, 0, "t")
                assert local.call("send", topic="t", body=b"local")[1] == "t"
            fds = {c.client: c._fd for c in running.broker.connections}
        assert fds["tls"] == -1 and fds["test"] >= 0, fds


@pytest.mark.parametrize("loop", LOOPS)
def test_direct_fd_only_for_a_plain_socket_transport(loop: str) -> None:
    """A plain socket transport of either loop gets its socket's fd; a transport of
    another kind gets -1."""

    class Other:
        def get_extra_info(self, name: str) -> Any:
            return None

    assert direct_fd(Other()) == -1  # type: ignore[arg-type]

    async def check() -> tuple[int, int]:
        left, right = socket.socketpair()
        own = left.fileno()
        try:
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                asyncio.Protocol, left
            )
            fd = direct_fd(transport)
            transport.close()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            return fd, own
        finally:
            right.close()

    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as run:
        fd, own = run.run(check())
    assert fd == own >= 0
