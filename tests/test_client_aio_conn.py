"""The asyncio client's connection state in C (equeue/cext/clientconn.c, the base of
aio.py's ``_Protocol``): its direct sends and the answers it reads in C under a SIGKILL
of the real broker with 64 connections waiting, a restart, and a hostile broker whose
answer to a direct send is broken; the outcomes are those of any send (equeue errors,
the send reported unanswered and not sent again), and an answer read in C waking a caller
waiting for a place."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer, temporary_broker
from server_helpers import short_dir

import equeue.aio
from equeue import MessageStore, speedups
from equeue.errors import ConnectionLostError, EQueueError, ProtocolError
from equeue.protocol.frames import FRAME_HEADER, PROTOCOL_VERSION, encode
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage, SendResult

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
CLIENTS = 64
RESULT: list[Any] = ["0123456789abcdef01234567", "t", 1, 2, 3, 1.5e9]


def _protocols(clients: list[equeue.aio.AsyncClient]) -> list[Any]:
    found = [client._protocol for client in clients]
    assert all(protocol is not None for protocol in found)
    return found


@needs_c
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sigkill_with_64_direct_sends_waiting_fails_each_and_a_restart_takes_the_next(
    loop: str,
) -> None:
    """64 clients each with one direct send written to a broker stopped (SIGSTOP) and
    then SIGKILLed: each send fails with ConnectionLostError naming its own message (none
    hangs: bounded); after a restart on the same store every client's next send
    reconnects and is stored, and no lost send was sent again (each body at most once).
    On asyncio's loop and uvloop (whose transports call get_buffer and buffer_updated too)."""
    new_loop = asyncio.new_event_loop
    if loop == "uvloop":
        new_loop = pytest.importorskip("uvloop").new_event_loop
    with temporary_broker("--flush", "sync") as broker:
        with equeue.connect(broker.url) as admin:
            admin.create_topic("t", 4)
        pid = broker.process.pid  # type: ignore[union-attr]

        async def main() -> tuple[list[BaseException | SendResult], int, list[SendResult]]:
            clients = [await equeue.aio.connect(broker.url, timeout=60) for _ in range(CLIENTS)]
            try:
                warm = await asyncio.gather(*(c.send("t", b"warm") for c in clients))
                assert len(warm) == CLIENTS
                os.kill(pid, signal.SIGSTOP)
                tasks = [
                    asyncio.create_task(c.send("t", f"w{i}".encode()))
                    for i, c in enumerate(clients)
                ]
                protocols = _protocols(clients)
                for _ in range(500):  # until each is written (at most ~5 s)
                    await asyncio.sleep(0.01)
                    if all(p.pending for p in protocols):
                        break
                direct = sum(1 for p in protocols if p.waiting)  # (written by ClientConn)
                broker.kill()
                async with asyncio.timeout(60):  # none hangs
                    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                broker.start()
                async with asyncio.timeout(60):
                    after = await asyncio.gather(
                        *(c.send("t", f"a{i}".encode()) for i, c in enumerate(clients))
                    )
                return outcomes, direct, after
            finally:
                for client in clients:
                    await client.close()

        running = new_loop()
        try:
            outcomes, direct, after = running.run_until_complete(main())
        finally:
            running.close()
        assert direct >= CLIENTS // 2, direct  # the path under test, mostly
        for index, outcome in enumerate(outcomes):
            assert isinstance(outcome, ConnectionLostError), outcome
            assert outcome.unanswered == [OutgoingMessage(f"w{index}".encode())]
        broker.stop()
        with MessageStore.open(broker.store) as store:
            bodies = [
                message.body
                for q in store.queue_ids("t")
                for message in store.pull("t", q, 0, 10_000).messages
            ]
            for result, index in zip(after, range(CLIENTS), strict=True):
                assert store.get(result.message_id).body == f"a{index}".encode()
        assert bodies.count(b"warm") == CLIENTS
        for index in range(CLIENTS):
            assert bodies.count(f"w{index}".encode()) <= 1  # never sent again
            assert bodies.count(f"a{index}".encode()) == 1


# A reply to the direct send: the bytes written, and the cause ConnectionLostError carries
# (None: the connection closed, no cause of the protocol's)
REPLIES: list[tuple[str, Any, type[BaseException] | None]] = [
    ("not msgpack", lambda rid: FRAME_HEADER.pack(4) + b"\xc1abc", ProtocolError),
    ("empty frame", lambda rid: FRAME_HEADER.pack(0), ProtocolError),
    ("another id", lambda rid: encode([rid + 7, 0, RESULT]), ProtocolError),
    ("truncated", lambda rid: encode([rid, 0, RESULT])[:-3], None),
    ("length only", lambda rid: FRAME_HEADER.pack(40), None),
    ("str status", lambda rid: encode([rid, "0", RESULT]), ProtocolError),
    ("id as str", lambda rid: encode([str(rid), 0, RESULT]), ProtocolError),
    ("negative id", lambda rid: encode([-rid, 0, RESULT]), ProtocolError),
]


@needs_c
@pytest.mark.parametrize(("name", "reply", "cause"), REPLIES, ids=[r[0] for r in REPLIES])
def test_a_broken_answer_to_a_direct_send_is_an_equeue_error(
    name: str, reply: Any, cause: type[BaseException] | None
) -> None:
    """The send was written by ClientConn.direct (``waiting`` set) and its answer read by
    ClientConn.buffer_updated: a broken answer is ConnectionLostError (its cause the
    protocol's error) naming the send; never a builtin exception."""
    written = threading.Event()
    go = threading.Event()

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": PROTOCOL_VERSION})
        request_id = peer.recv()[0]
        written.set()
        go.wait(10)
        peer.raw(reply(request_id))
        # (then the fake closes: the truncated cases end that way)

    async def main(url: str) -> None:
        client = await equeue.aio.connect(url, timeout=10)
        try:
            task = asyncio.create_task(client.send("t", b"body"))
            for _ in range(1000):  # until the fake has it (at most ~10 s)
                await asyncio.sleep(0.01)
                if written.is_set():
                    break
            protocol = client._protocol
            assert protocol is not None and protocol.waiting  # the direct path
            go.set()
            async with asyncio.timeout(30):
                with pytest.raises(ConnectionLostError) as raised:
                    await task
            if cause is not None:
                assert isinstance(raised.value.__cause__, cause), raised.value.__cause__
            assert raised.value.unanswered == [OutgoingMessage(b"body")]
            assert protocol.read_in_c == 0 and protocol.closed and not protocol.pending
        finally:
            go.set()
            await client.close()

    with FakeBroker(script) as fake:
        asyncio.run(main(fake.url))
        assert fake.errors == []


@needs_c
@pytest.mark.parametrize("result", [["id", "t", "q", 2, 3, 1.5], RESULT[:5], [*RESULT, 0]])
def test_an_ok_answer_of_the_wrong_shape_is_a_protocol_error_for_its_send(
    result: list[Any],
) -> None:
    """An OK answer whose SendResult does not decode: not read in C; the send raises the
    decoder's ProtocolError (what is wrong) and the connection goes on."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": PROTOCOL_VERSION})
        peer.send([peer.recv()[0], 0, result])
        peer.send([peer.recv()[0], 0, RESULT])
        peer.recv()  # (until the client closes)

    async def main(url: str) -> None:
        client = await equeue.aio.connect(url, timeout=10)
        try:
            async with asyncio.timeout(30):
                with pytest.raises(ProtocolError, match="SendResult"):
                    await client.send("t", b"body")
                assert await client.send("t", b"next") == SendResult(*RESULT)
            protocol = client._protocol
            assert protocol is not None and protocol.read_in_c == 1 and not protocol.closed
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        asyncio.run(main(fake.url))
        assert fake.errors == []


@needs_c
def test_an_answer_with_garbage_after_it_loses_the_connection_and_names_the_send() -> None:
    """The right answer and then a broken frame in one read: not read in C (not exactly
    one frame); the general read refuses the read whole, so the send is reported
    unanswered (it may be stored: not known from this read)."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": PROTOCOL_VERSION})
        request_id = peer.recv()[0]
        peer.raw(encode([request_id, 0, RESULT]) + FRAME_HEADER.pack(4) + b"\xc1abc")
        peer.recv()  # (until the client closes)

    async def main(url: str) -> None:
        client = await equeue.aio.connect(url, timeout=10)
        try:
            async with asyncio.timeout(30):
                with pytest.raises(ConnectionLostError) as raised:
                    await client.send("t", b"body")
            assert isinstance(raised.value.__cause__, ProtocolError)
            assert raised.value.unanswered == [OutgoingMessage(b"body")]
            protocol = client._protocol
            assert protocol is not None and protocol.read_in_c == 0 and protocol.closed
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        asyncio.run(main(fake.url))


def test_no_builtin_exception_from_random_answers_to_direct_sends() -> None:
    """Seeded random bytes (a valid length prefix, random payload) answering each send:
    every outcome is a result or an EQueueError."""
    import random

    rng = random.Random(32)
    replies = [
        FRAME_HEADER.pack(n) + bytes(rng.randrange(256) for _ in range(n))
        for n in [rng.randrange(1, 60) for _ in range(40)]
    ]

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": PROTOCOL_VERSION})
        while True:
            request_id = peer.recv()[0]
            peer.raw(replies[request_id % len(replies)])

    async def main(url: str) -> list[str]:
        client = await equeue.aio.connect(url, timeout=5, connect_timeout=5)
        seen = []
        try:
            for _ in range(len(replies)):
                try:
                    async with asyncio.timeout(30):
                        await client.send("t", b"x")
                    seen.append("result")
                except EQueueError as exc:
                    seen.append(type(exc).__name__)
        finally:
            await client.close()
        return seen

    with FakeBroker(script) as fake:
        seen = asyncio.run(main(fake.url))
    assert len(seen) == len(replies) and "ConnectionLostError" in seen


@needs_c
@pytest.mark.parametrize("flush", ["async", "sync"])
def test_an_answer_read_in_c_releases_a_caller_waiting_for_the_only_place(flush: str) -> None:
    """Review 32a F5: at a broker's max_in_flight 1 a direct send takes the only place and
    the concurrent sends wait in ``queued``; the answer ClientConn reads in C frees the
    place and must wake the next caller (answered() calls release()). 3 rounds of 4
    concurrent sends on one client all answered (a hang guard of 30 s, not a timing),
    some answers read in C, nothing left waiting."""

    async def run(url: str) -> tuple[list[str], int, int, int]:
        client = await equeue.aio.connect(url, timeout=10)
        try:
            protocol = client._protocol
            assert protocol is not None
            ids: list[str] = []
            async with asyncio.timeout(30):
                await client.send("t", b"warm")
                assert protocol.max_in_flight == 1
                for round_ in range(3):
                    sends = (client.send("t", b"%d-%d" % (round_, i)) for i in range(4))
                    ids += [r.message_id for r in await asyncio.gather(*sends)]
            return ids, protocol.read_in_c, len(protocol.queued), protocol.free
        finally:
            await client.close()

    directory = short_dir()
    try:
        with BrokerThread(directory / "s", flush=flush, max_in_flight=1) as running:
            ids, read_in_c, waiting, free = asyncio.run(run(running.urls[0]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert len(set(ids)) == 12
    assert read_in_c > 0 and waiting == 0 and free == 1
