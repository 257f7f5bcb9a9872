"""One loop reader for many of the asyncio client's own transports (equeue/client/readers.py,
equeue/cext/readmux.c). On socketpairs (no broker): the first transport on a loop is its
own reader; from the second on the loop has one reader, the ReadMux's epoll descriptor,
and none of ours once the last stops; every transport's bytes arrive, before and after
the switch; a read that aborts another transport of the same turn leaves that one
unread and lost once; an exception out of a read reaches run_until_complete as from a
reader of its own, and the others are read in the next turn. Against the real broker
(`equeue serve --flush sync`): 16 clients on one loop, every send acknowledged and stored,
one closed midway; and a SIGKILL with 8 connections' sends in flight fails each, naming
its message, a restart takes the next sends."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Any

import pytest
from client_helpers import temporary_broker

import equeue
import equeue.aio
from equeue import speedups
from equeue.client import rawconn, readers
from equeue.errors import ConnectionLostError
from equeue.protocol.plainsend import read_mux_type
from equeue.store.types import OutgoingMessage

pytestmark = pytest.mark.skipif(
    speedups.SPEEDUPS is None or read_mux_type is None, reason="no C accelerator or no epoll"
)


class _Recording(asyncio.BufferedProtocol):
    """Records the bytes read; ``on_read(self)`` runs after each read."""

    def __init__(self, on_read: Any = None) -> None:
        self.buffer = bytearray(4096)
        self.read = bytearray()
        self.lost: list[BaseException | None] = []
        self.on_read = on_read

    def get_buffer(self, sizehint: int) -> Any:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.read += self.buffer[:nbytes]
        if self.on_read is not None:
            self.on_read(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)


def _pair(protocol: _Recording) -> tuple[Any, socket.socket]:
    near, far = socket.socketpair()
    near.setblocking(False)
    transport = rawconn.RawTransport(asyncio.get_running_loop(), near, protocol)
    transport.start()
    return transport, far


def _reader_fds() -> set[int]:
    """The descriptors the running loop's selector watches for reading."""
    loop: Any = asyncio.get_running_loop()
    return {key.fd for key in loop._selector.get_map().values() if key.data[0] is not None}


async def _turns(count: int = 3) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_the_second_transport_on_a_loop_puts_both_behind_one_reader() -> None:
    async def main() -> None:
        baseline = _reader_fds()  # (the loop's self-pipe)
        first = _Recording()
        a, a_far = _pair(first)
        assert _reader_fds() == baseline | {a.fd}
        a_far.send(b"before")
        await _turns()
        assert first.read == b"before"

        protocols = [_Recording() for _ in range(3)]
        pairs = [_pair(p) for p in protocols]
        watched = _reader_fds() - baseline
        assert len(watched) == 1, watched  # the ReadMux's epoll fd, not a, nor the others
        assert not watched & {a.fd, *(t.fd for t, _ in pairs)}

        a_far.send(b" after")
        for i, (_, far) in enumerate(pairs):
            far.send(b"to %d" % i)
        await _turns()
        assert first.read == b"before after"
        assert [bytes(p.read) for p in protocols] == [b"to 0", b"to 1", b"to 2"]

        a.close()
        await _turns()
        assert first.lost == [None]
        pairs[0][1].send(b" more")
        await _turns()
        assert protocols[0].read == b"to 0 more"
        assert _reader_fds() - baseline == watched  # the others still behind the mux

        for transport, _ in pairs:
            transport.close()
        await _turns()
        assert _reader_fds() == baseline  # the mux's reader gone with its last transport
        assert all(p.lost == [None] for p in protocols)
        for far in (a_far, *(f for _, f in pairs)):
            far.close()

    asyncio.run(main())


@pytest.mark.parametrize("per_loop", [1, 2, 3])
def test_a_loop_dropped_with_transports_open_frees_them(per_loop: int) -> None:
    """asyncio.run ending with the client's transports unclosed (an exception path, a
    cancelled task): once the loop is collected its transports' sockets are closed (the
    far ends read EOF), one reader of its own or behind the mux. The per-loop state held
    its loop from a WeakKeyDictionary's value once: every such socket stayed open."""
    import gc

    fars: list[socket.socket] = []

    async def leave_open() -> None:
        for _ in range(per_loop):
            fars.append(_pair(_Recording())[1])

    for _ in range(5):
        asyncio.run(leave_open())
    gc.collect()
    gc.collect()
    closed = 0
    for far in fars:
        far.settimeout(5.0)  # (EOF at once once freed; a socket left open times out)
        with contextlib.suppress(TimeoutError):
            closed += far.recv(1) == b""
        far.close()
    assert closed == len(fars)


def test_the_mux_reads_in_a_context_of_its_own() -> None:
    """The reads behind the mux run in a context of their own, not in that of the task
    which opened the loop's second transport."""
    import contextvars

    mark: contextvars.ContextVar[str] = contextvars.ContextVar("mark", default="none")
    seen: list[str] = []

    async def main() -> None:
        a, a_far = _pair(_Recording(on_read=lambda _: seen.append(mark.get())))

        async def opener() -> tuple[Any, socket.socket]:
            mark.set("opener")
            return _pair(_Recording(on_read=lambda _: seen.append(mark.get())))

        b, b_far = await asyncio.create_task(opener())
        a_far.send(b"a")
        b_far.send(b"b")
        await _turns()
        for transport, far in ((a, a_far), (b, b_far)):
            transport.close()
            far.close()
        await _turns()

    asyncio.run(main())
    assert seen == ["none", "none"]


def test_a_read_that_aborts_another_transport_of_the_same_turn() -> None:
    """a's read aborts b, whose bytes came in the same turn: b is not read, and is lost
    once (with no error, as abort() gives); a and c read theirs."""

    async def main() -> tuple[_Recording, _Recording, _Recording]:
        b_side = _Recording()
        b_holder: list[Any] = []
        a_side = _Recording(on_read=lambda _: b_holder[0].abort())
        c_side = _Recording()
        (a, a_far), (b, b_far), (c, c_far) = _pair(a_side), _pair(b_side), _pair(c_side)
        b_holder.append(b)
        # (b, then c, then a: whatever the order epoll gives them in, b must stay unread)
        for far, data in ((b_far, b"b"), (c_far, b"c"), (a_far, b"a")):
            far.send(data)
        await _turns()
        assert b.is_closing()
        assert b.fd == -1  # (connection_lost ran; its socket closed once)
        for transport in (a, c):
            transport.close()
        await _turns()
        for far in (a_far, b_far, c_far):
            far.close()
        return a_side, b_side, c_side

    a_side, b_side, c_side = asyncio.run(main())
    if b_side.read:  # epoll gave b before a: b was read before a aborted it (fine)
        assert b_side.read == b"b"
    assert a_side.read == b"a" and c_side.read == b"c"
    assert b_side.lost == [None]


def test_an_exception_out_of_a_read_reaches_the_loop_then_the_rest_are_read() -> None:
    """KeyboardInterrupt from a protocol read through the mux ends run_until_complete as
    from a reader of its own; the other transports' bytes are read in the next run."""
    loop = asyncio.new_event_loop()
    raised: list[int] = []

    def interrupt(protocol: _Recording) -> None:
        if not raised:
            raised.append(1)
            raise KeyboardInterrupt

    try:

        async def setup() -> list[tuple[Any, socket.socket, _Recording]]:
            made = []
            for hook in (interrupt, None, None):
                protocol = _Recording(on_read=hook)
                transport, far = _pair(protocol)
                made.append((transport, far, protocol))
            return made

        made = loop.run_until_complete(setup())
        for _, far, _ in made:
            far.send(b"x")
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(asyncio.sleep(0.05))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert [bytes(p.read) for _, _, p in made] == [b"x", b"x", b"x"]
        assert all(not t.is_closing() for t, _, _ in made)  # (an interrupt is no error)
        for transport, far, _ in made:
            transport.close()
            far.close()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()


def test_16_clients_on_one_loop_against_the_broker() -> None:
    with temporary_broker("--flush", "sync") as broker:

        async def main() -> tuple[int, list[Any]]:
            clients = [await equeue.aio.connect(broker.url) for _ in range(16)]
            await clients[0].create_topic("t", 4)
            assert all(type(c._protocol.transport).__name__ == "RawTransport" for c in clients)  # type: ignore[union-attr]
            state = readers._readers_of(asyncio.get_running_loop(), make=False)
            assert state is not None
            muxed = state.mux
            assert muxed is not None and len(muxed) == 16

            async def producer(index: int, client: equeue.aio.AsyncClient) -> list[Any]:
                results = []
                for i in range(50):
                    results.append(await client.send("t", b"%d-%d" % (index, i)))
                    if index == 0 and i == 20:
                        await client.close()  # (closed midway: the others go on)
                        break
                return results

            done = await asyncio.gather(*(producer(i, c) for i, c in enumerate(clients)))
            assert len(muxed) == 15
            for client in clients[1:]:
                await client.close()
            await _turns()
            state = readers._readers_of(asyncio.get_running_loop(), make=False)
            assert state is not None and state.mux is None
            return len(done[0]), [r for results in done for r in results]

        first, results = asyncio.run(main())
        assert first == 21
        assert len(results) == 21 + 15 * 50
        with equeue.connect(broker.url) as check:
            for result in results[::37]:
                assert check.get(result.message_id).body.count(b"-") == 1


def test_sigkill_with_8_connections_in_flight_then_a_restart() -> None:
    with temporary_broker("--flush", "sync") as broker:

        async def main() -> list[Any]:
            clients = [
                await equeue.aio.connect(broker.url, timeout=60, connect_timeout=30)
                for _ in range(8)
            ]
            try:
                await clients[0].create_topic("t", 2)
                await asyncio.gather(*(c.send("t", b"warm") for c in clients))
                broker.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
                tasks = [
                    asyncio.ensure_future(c.send("t", b"%d" % i, queue_id=1))
                    for i, c in enumerate(clients)
                ]
                await asyncio.sleep(0.05)
                broker.kill()
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), 30
                )
                for i, outcome in enumerate(outcomes):
                    assert isinstance(outcome, ConnectionLostError), outcome
                    assert outcome.unanswered == [OutgoingMessage(b"%d" % i, queue_id=1)]
                broker.start()
                return list(await asyncio.gather(*(c.send("t", b"after") for c in clients)))
            finally:
                for client in clients:
                    await client.close()

        after = asyncio.run(main())
        assert len({r.message_id for r in after}) == 8
        with equeue.connect(broker.url) as check:
            assert all(check.get(r.message_id).body == b"after" for r in after)
