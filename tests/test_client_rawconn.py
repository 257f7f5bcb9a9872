"""The asyncio client's own transport on selector loops (equeue/client/rawconn.py,
equeue/cext/rawsock.c) against the real broker: taken on asyncio's loop and a subclass
of it, not on uvloop or TLS; a write queued behind a stalled (SIGSTOP) broker with a
small send buffer drains in order with pause_writing/resume_writing; a SIGKILLed broker
fails each send in flight (written or still queued) naming its message, and a restart
takes the next; close() from the owning loop and from another loop's thread closes the
fd once (100 cycles: no fd left); a send cancelled while its answer is in flight;
send_batch, pull and a consumer group over it. On a socketpair (no broker), each also
against asyncio's transport: a write while bytes are queued goes behind them; a write
that meets a full socket is queued, not lost; a failing get_buffer reported with
asyncio's message; and a refused connect leaves no reference cycle."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker
from server_helpers import short_home
from test_server_auth import _self_signed

import equeue.aio
from equeue import speedups
from equeue.client import rawconn
from equeue.client.url import parse_url
from equeue.errors import ConnectionLostError
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
home = pytest.fixture(short_home, name="home")


@pytest.fixture(scope="module", name="shared")
def _shared() -> Iterator[BrokerProcess]:
    """One broker for the tests that neither kill nor restart it (each its own topic)."""
    with temporary_broker() as broker:
        yield broker


def _transport(client: equeue.aio.AsyncClient) -> Any:
    assert client._protocol is not None
    return client._protocol.transport


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Subclass(asyncio.SelectorEventLoop):
    pass


@pytest.mark.parametrize("make", [asyncio.new_event_loop, _Subclass, "uvloop"])
def test_the_own_transport_on_selector_loops_only(make: Any, shared: BrokerProcess) -> None:
    """asyncio's default loop and a user's subclass of it: RawTransport; uvloop: its own."""
    if make == "uvloop":
        make = pytest.importorskip("uvloop").new_event_loop
    loop = make()

    async def main() -> tuple[str, int]:
        async with await equeue.aio.connect(shared.url) as client:
            await client.create_topic("t", 2)
            sent = await client.send("t", b"over it")
            assert (await client.get(sent.message_id)).body == b"over it"
            assert client._protocol is not None
            return type(_transport(client)).__name__, client._protocol.read_in_c

    try:
        kind, read_in_c = loop.run_until_complete(main())
    finally:
        loop.close()
    fast = isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
    assert (kind == "RawTransport") is fast, kind
    assert read_in_c >= 1  # the direct send's answer read in C on either


@pytest.mark.parametrize("name", ["buffer_updated", "get_buffer"])
def test_a_read_method_replaced_on_the_protocols_class_is_called(
    name: str, shared: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RawTransport's read calls ClientConn's get_buffer and buffer_updated in C only
    while the protocol's class finds ClientConn's own (remembered with the class's
    version tag, as the send's first step does): one replaced on the class later is
    called for every read, and once put back C calls ClientConn's again."""
    protocol_class: Any = equeue.client.aio._Protocol
    original = getattr(protocol_class, name)
    calls: list[int] = []

    def counting(self: Any, arg: int) -> Any:
        calls.append(arg)
        return original(self, arg)

    async def main() -> tuple[str, int, int]:
        async with await equeue.aio.connect(shared.url) as client:
            await client.create_topic("rp", 1)
            await client.send("rp", b"before")
            monkeypatch.setattr(protocol_class, name, counting)
            for n in range(3):
                await client.send("rp", b"%d" % n)
            replaced = len(calls)
            monkeypatch.undo()
            for n in range(3):
                await client.send("rp", b"after %d" % n)
            return type(_transport(client)).__name__, replaced, len(calls)

    loop = asyncio.new_event_loop()
    try:
        kind, replaced, after = loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        monkeypatch.undo()
        loop.close()
    assert kind == "RawTransport"
    assert replaced >= 3 and after == replaced  # (an answer a read: at least one each)


def test_tls_and_tcp(home: Path) -> None:
    """TLS keeps asyncio's transport (usable says no, and the connection shows it); plain
    TCP on loopback takes the own one, TCP_NODELAY set as asyncio sets it."""
    cert, key = _self_signed(home)
    with BrokerThread(
        home / "s", listen=["tls://127.0.0.1:0", "tcp://127.0.0.1:0"],
        tls_cert=str(cert), tls_key=str(key),
    ) as running:  # fmt: skip
        tls_url, tcp_url = running.urls

        async def main() -> tuple[str, str, int]:
            context = ssl.create_default_context(cafile=str(cert))
            assert not rawconn.usable(
                asyncio.get_running_loop(), parse_url(tls_url, ssl_context=context), None
            )
            async with await equeue.aio.connect(tls_url, ssl_context=context) as tls:
                await tls.send("t", b"tls")
                tls_kind = type(_transport(tls)).__name__
            async with await equeue.aio.connect(tcp_url) as tcp:
                results = await asyncio.gather(*(tcp.send("t", b"x") for _ in range(100)))
                assert len({r.message_id for r in results}) == 100
                sock = _transport(tcp).get_extra_info("socket")
                nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                return tls_kind, type(_transport(tcp)).__name__, nodelay

        tls_kind, tcp_kind, nodelay = asyncio.run(main())
    assert tls_kind != "RawTransport"
    assert tcp_kind == "RawTransport"
    assert nodelay == 1


def test_a_stalled_broker_queues_the_writes_which_drain_in_order() -> None:
    """The broker SIGSTOPped, a 4 KiB send buffer and 300 sends of 2 KiB: the rest waits
    in the transport (more than the 64 KiB high-water mark: pause_writing), and after
    SIGCONT every send is stored, in the order sent (one queue), resume_writing called."""
    with temporary_broker() as broker:
        pid = broker.process.pid  # type: ignore[union-attr]

        async def main() -> tuple[list[str], int, list[bytes], list[bytes]]:
            client = await equeue.aio.connect(broker.url, timeout=60)
            try:
                await client.create_topic("t", 1)
                await client.send("t", b"warm")
                transport = _transport(client)
                transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
                )
                calls: list[str] = []
                protocol: Any = client._protocol
                protocol.pause_writing = lambda: calls.append("pause")
                protocol.resume_writing = lambda: calls.append("resume")
                bodies = [i.to_bytes(4, "big") * 512 for i in range(300)]
                os.kill(pid, signal.SIGSTOP)
                try:
                    tasks = [
                        asyncio.ensure_future(client.send("t", body, queue_id=0)) for body in bodies
                    ]
                    for _ in range(20):  # (bounded: the turns that write them)
                        await asyncio.sleep(0.01)
                    queued = transport.get_write_buffer_size()
                finally:
                    os.kill(pid, signal.SIGCONT)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                assert [r.queue_offset for r in results] == list(range(1, 301))
                pulled: list[bytes] = []
                while len(pulled) < 301:  # (bounded by the offsets: each pull advances)
                    got = await client.pull("t", 0, len(pulled), max_count=500)
                    assert got, len(pulled)
                    pulled += [m.body for m in got]
                return calls, queued, pulled[1:], bodies
            finally:
                await client.close()

        calls, queued, pulled, bodies = asyncio.run(main())
    assert queued > rawconn.HIGH_WATER, queued
    assert calls == ["pause", "resume"], calls
    assert pulled == bodies


@pytest.mark.parametrize("stalled", [False, True])
def test_sigkill_fails_each_send_in_flight_and_a_restart_takes_the_next(stalled: bool) -> None:
    """50 sends in flight (written, or still queued in the transport behind a stalled
    broker with a small send buffer) when the broker is SIGKILLed: each raises
    ConnectionLostError naming its own message as unanswered; the old socket is closed
    (its fd gone), and after a restart the next send reconnects, on a new RawTransport."""
    with temporary_broker("--flush", "sync") as broker:
        pid = broker.process.pid  # type: ignore[union-attr]

        async def main() -> tuple[list[BaseException | Any], int, Any, Any]:
            client = await equeue.aio.connect(broker.url, timeout=60, connect_timeout=30)
            try:
                await client.create_topic("t", 2)
                await client.send("t", b"warm")
                old = _transport(client)
                fd = old.fd
                if stalled:
                    old.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
                    )
                os.kill(pid, signal.SIGSTOP)
                bodies = [b"%d" % i * (2000 if stalled else 1) for i in range(50)]
                tasks = [asyncio.ensure_future(client.send("t", b, queue_id=1)) for b in bodies]
                for _ in range(5):
                    await asyncio.sleep(0.01)
                queued = old.get_write_buffer_size()
                broker.kill()
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), 30
                )
                for body, outcome in zip(bodies, outcomes, strict=True):
                    assert isinstance(outcome, ConnectionLostError), outcome
                    assert outcome.unanswered == [OutgoingMessage(body, queue_id=1)]
                assert old.fd == -1
                with pytest.raises(OSError):  # (closed: no other fd opened since)
                    os.fstat(fd)
                broker.start()
                after = await client.send("t", b"after")
                return outcomes, queued, after, _transport(client)
            finally:
                await client.close()

        outcomes, queued, after, new = asyncio.run(main())
    assert len(outcomes) == 50
    assert (queued > 0) is stalled, queued
    assert after.topic == "t"
    assert type(new).__name__ == "RawTransport"


def test_100_connect_close_cycles_leave_no_fd_and_close_from_another_loop(
    shared: BrokerProcess,
) -> None:
    """close() on the owning loop, 100 times: the fd count is as before. A client made on
    a loop running in another thread, closed from this thread's loop: its socket is
    closed there (once: the fd count is back, and a send raises ClosedError)."""

    async def cycles() -> None:
        for _ in range(100):
            client = await equeue.aio.connect(shared.url)
            await client.ping()
            await client.close()
        await asyncio.sleep(0)  # (connection_lost runs in the next turn)
        await asyncio.sleep(0)

    asyncio.run(cycles())  # (the loop's own fds come and go with it)
    before = _fds()
    asyncio.run(cycles())
    assert _fds() == before

    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever)
    thread.start()
    try:
        made = asyncio.run_coroutine_threadsafe(equeue.aio.connect(shared.url), other)
        client = made.result(30)
        asyncio.run_coroutine_threadsafe(client.ping(), other).result(30)
        transport = _transport(client)
        fd = transport.fd
        during = _fds()
        asyncio.run(client.close())  # (from this thread's loop: done on `other`)
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.01), other).result(30)
        assert transport.fd == -1
        assert transport.is_closing()
        with pytest.raises(OSError):
            os.fstat(fd)
        assert _fds() == during - 1
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(30)
        other.close()


def test_a_send_cancelled_while_its_answer_is_in_flight(shared: BrokerProcess) -> None:
    """A direct send written, its caller cancelled while the broker (stopped) holds it:
    its late answer is dropped, its place comes back, and the next sends are answered."""
    pid = shared.process.pid  # type: ignore[union-attr]

    async def main() -> tuple[int, int, list[int]]:
        async with await equeue.aio.connect(shared.url, timeout=60) as client:
            await client.create_topic("cancel", 1)
            await client.send("cancel", b"warm")
            protocol: Any = client._protocol
            free = protocol.free
            os.kill(pid, signal.SIGSTOP)
            try:
                task = asyncio.ensure_future(client.send("cancel", b"cancelled"))
                await asyncio.sleep(0.01)
                assert len(protocol.pending) == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                os.kill(pid, signal.SIGCONT)
            for _ in range(500):  # (bounded: until the late answer is read)
                if not protocol.pending:
                    break
                await asyncio.sleep(0.01)
            after = [(await client.send("cancel", b"n%d" % i)).queue_offset for i in range(3)]
            return free, protocol.free, after

    free, free_after, after = asyncio.run(main())
    assert free_after == free
    assert after == [2, 3, 4]  # (the cancelled send was stored: offset 1)


def test_send_batch_pull_and_a_consumer_over_it(shared: BrokerProcess) -> None:
    """2,000 bodies in one send_batch, their answer read in one or more reads, pulled and
    consumed by a group member, in order, over the own transport."""

    async def main() -> tuple[list[int], list[bytes], list[bytes], str]:
        async with await equeue.aio.connect(shared.url) as client:
            await client.create_topic("batch", 1)
            batch = [b"b%d" % i for i in range(2000)]
            results = await client.send_batch("batch", batch)
            pulled: list[bytes] = []
            while len(pulled) < len(batch):  # (bounded: each pull advances)
                got = await client.pull("batch", 0, len(pulled), max_count=1000)
                assert got
                pulled += [m.body for m in got]
            seen: list[bytes] = []
            async with client.consumer("g", "batch") as consumer:
                while len(seen) < len(batch):  # (bounded: poll's timeout ends it)
                    message = await consumer.poll(10)
                    assert message is not None
                    seen.append(message.body)
            return (
                [r.queue_offset for r in results],
                pulled,
                seen,
                type(_transport(client)).__name__,
            )

    offsets, pulled, seen, kind = asyncio.run(main())
    assert offsets == list(range(2000))
    assert pulled == seen == [b"b%d" % i for i in range(2000)]
    assert kind == "RawTransport"


@pytest.mark.parametrize("own", [True, False])
def test_an_exception_of_the_protocol_is_reported_as_by_asyncios_transport(
    own: bool, monkeypatch: pytest.MonkeyPatch, shared: BrokerProcess
) -> None:
    """The protocol's read raising (its data_received replaced): the loop's exception
    handler gets asyncio's message and the exception, the connection is lost with it,
    and the request in flight raises ConnectionLostError; the same with asyncio's own
    transport (``usable`` patched to say no), where the next call reconnects."""
    if not own:
        monkeypatch.setattr(rawconn, "usable", lambda *_: False)

    async def main() -> tuple[list[dict[str, Any]], BaseException | None, str, bool]:
        seen: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, c: seen.append(c))
        async with await equeue.aio.connect(shared.url) as client:
            await client.ping()
            protocol: Any = client._protocol
            kind = type(protocol.transport).__name__

            def broken(data: object) -> None:
                raise RuntimeError("broken read")

            protocol.data_received = broken
            raised: BaseException | None = None
            try:
                await asyncio.wait_for(client.ping(), 30)
            except ConnectionLostError as exc:
                raised = exc
            await client.ping()  # (a new connection)
            return seen, raised, kind, client._protocol is not protocol

    seen, raised, kind, renewed = asyncio.run(main())
    assert (kind == "RawTransport") is own
    assert [c["message"] for c in seen] == ["Fatal error: protocol.buffer_updated() call failed."]
    assert isinstance(seen[0]["exception"], RuntimeError)
    assert isinstance(raised, ConnectionLostError)
    assert "broken read" in str(raised)
    assert renewed


@pytest.mark.parametrize("own", [True, False])
def test_a_refused_connect_raises_as_with_asyncios_transport(
    own: bool, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    """No broker at a unix path, and a closed loopback port: after connect_timeout the
    same ConnectionLostError (its last error FileNotFoundError / ConnectionRefusedError)
    on both transports, and no socket left open."""
    if not own:
        monkeypatch.setattr(rawconn, "usable", lambda *_: False)
    with socket.socket() as probe:  # a port nothing listens on (closed again at once)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main() -> list[tuple[str, str]]:
        found = []
        for url in (f"unix:{home / 'none.sock'}", f"tcp://127.0.0.1:{port}"):
            with pytest.raises(ConnectionLostError) as raised:
                await equeue.aio.connect(url, connect_timeout=0.2)
            cause = raised.value.__cause__
            text = str(raised.value)
            found.append((type(cause).__name__, text[: text.index("(")]))
        return found

    before = _fds()
    found = asyncio.run(main())
    assert _fds() == before
    assert found == [
        ("FileNotFoundError", f"cannot connect to the broker at unix:{home / 'none.sock'} "
         "within connect_timeout=0.2s "),
        ("ConnectionRefusedError", f"cannot connect to the broker at tcp://127.0.0.1:{port} "
         "within connect_timeout=0.2s "),
    ]  # fmt: skip


class _Recording(asyncio.BufferedProtocol):
    """A bare BufferedProtocol for a socketpair (no broker): records what the transport
    calls; ``get_buffer`` may raise or return an empty buffer."""

    def __init__(self, buffer: Any = None) -> None:
        self.calls: list[str] = []
        self.lost: list[BaseException | None] = []
        self.buffer = bytearray(1024) if buffer is None else buffer

    def get_buffer(self, sizehint: int) -> Any:
        if isinstance(self.buffer, BaseException):
            raise self.buffer
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.calls.append("buffer_updated")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)

    def pause_writing(self) -> None:
        self.calls.append("pause")

    def resume_writing(self) -> None:
        self.calls.append("resume")


async def _pair(own: bool, protocol: _Recording) -> tuple[Any, socket.socket]:
    """A non-blocking socketpair's one end under RawTransport (own) or asyncio's
    transport (create_connection(sock=)), and the other end, non-blocking, to read."""
    near, far = socket.socketpair()
    near.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # (full well before 1 MB)
    near.setblocking(False)
    far.setblocking(False)
    loop = asyncio.get_running_loop()
    if own:
        transport: Any = rawconn.RawTransport(loop, near, protocol)
        transport.start()
    else:
        transport, _ = await loop.create_connection(lambda: protocol, sock=near)
    assert (type(transport).__name__ == "RawTransport") is own
    return transport, far


def _drain(far: socket.socket, into: bytearray) -> None:
    """What the kernel holds for ``far`` now, without waiting."""
    while True:
        try:
            chunk = far.recv(1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            return
        into += chunk


async def _read_until(far: socket.socket, into: bytearray, size: int) -> None:
    for _ in range(5000):  # (bounded: 1 ms turns, the transport writing the rest)
        _drain(far, into)
        if len(into) >= size:
            return
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("own", [True, False])
def test_a_write_while_bytes_are_queued_goes_behind_them(own: bool) -> None:
    """1 MB written (more than the socket holds: the rest queued), the peer then reads all
    the kernel holds, and a marker is written in the same loop turn, before the transport
    is told the socket is writable: the marker comes after the last queued byte, on both
    transports (sent at once it would land in the middle, splitting a frame)."""

    async def main() -> tuple[int, int, list[str]]:
        protocol = _Recording()
        transport, far = await _pair(own, protocol)
        try:
            big = b"A" * 1_000_000
            transport.write(big)
            queued = transport.get_write_buffer_size()
            got = bytearray()
            _drain(far, got)  # (room in the socket again; the loop has not run)
            transport.write(b"MARK")
            await _read_until(far, got, len(big) + 4)
            return queued, bytes(got).find(b"MARK"), protocol.calls
        finally:
            transport.close()
            await asyncio.sleep(0)
            far.close()

    queued, where, calls = asyncio.run(main())
    assert 0 < queued < 1_000_000, queued
    assert where == 1_000_000, where
    assert calls == ["pause", "resume"]


@pytest.mark.parametrize("own", [True, False])
def test_a_write_that_meets_a_full_socket_is_queued_not_lost(own: bool) -> None:
    """8-byte writes (each sent whole or not at all) until one finds the socket full with
    nothing queued (send() raises EAGAIN, nothing sent): that write is queued whole, and
    the peer reads every write, in order, on both transports."""

    async def main() -> tuple[int, bytes, bytes]:
        protocol = _Recording()
        transport, far = await _pair(own, protocol)
        try:
            written: list[bytes] = []
            while transport.get_write_buffer_size() == 0 and len(written) < 100_000:
                written.append(b"%08d" % len(written))
                transport.write(written[-1])
            queued = transport.get_write_buffer_size()
            written.append(b"%08d" % len(written))
            transport.write(written[-1])  # (behind the queued one)
            want = b"".join(written)
            got = bytearray()
            await _read_until(far, got, len(want))
            return queued, bytes(got), want
        finally:
            transport.close()
            await asyncio.sleep(0)
            far.close()

    queued, got, want = asyncio.run(main())
    assert queued == 8  # (the write that met EAGAIN, whole: nothing of it sent)
    assert len(want) < 800_000
    assert got == want


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("failure", ["raises", "empty"])
def test_a_failing_get_buffer_is_reported_as_by_asyncios_transport(own: bool, failure: str) -> None:
    """The protocol's get_buffer raising, or returning an empty buffer, when bytes come:
    the loop's exception handler gets asyncio's message for it and a RuntimeError, and
    the connection is lost with that exception, on both transports."""

    async def main() -> tuple[list[dict[str, Any]], list[BaseException | None]]:
        seen: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, c: seen.append(c))
        buffer = RuntimeError("no buffer") if failure == "raises" else bytearray()
        protocol = _Recording(buffer)
        transport, far = await _pair(own, protocol)
        try:
            far.send(b"bytes")
            for _ in range(500):  # (bounded: until connection_lost has run)
                if protocol.lost:
                    break
                await asyncio.sleep(0.001)
        finally:
            transport.close()
            await asyncio.sleep(0)
            far.close()
        return seen, protocol.lost

    seen, lost = asyncio.run(main())
    assert [c["message"] for c in seen] == ["Fatal error: protocol.get_buffer() call failed."]
    assert isinstance(seen[0]["exception"], RuntimeError)
    assert lost == [seen[0]["exception"]]


@pytest.mark.parametrize("addresses", [1, 2])
def test_a_refused_connect_leaves_no_cycle_through_its_errors(addresses: int) -> None:
    """A connect refused at one address (its error raised) or at two (an OSError naming
    both): no list still holds the raised error, and the connecting frame (in its
    traceback) holds none of them: no reference cycle left for the cyclic GC, as asyncio's
    create_connection leaves none."""
    ports = []
    for _ in range(2):  # ports nothing listens on (closed again at once)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])

    async def main() -> tuple[str, list[str], list[list[Any]]]:
        loop: Any = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def each(host: str, port: int, **kwargs: Any) -> list[Any]:
            found = [await real(host, p, **kwargs) for p in ports[:addresses]]
            return [info for infos in found for info in infos]

        loop.getaddrinfo = each
        with pytest.raises(OSError) as raised:
            await rawconn._tcp(loop, "127.0.0.1", ports[0])
        exc = raised.value
        holders = [type(r).__name__ for r in gc.get_referrers(exc)]
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code is not rawconn._tcp.__code__:
            tb = tb.tb_next
        assert tb is not None
        held = [
            v
            for v in tb.tb_frame.f_locals.values()
            if isinstance(v, list) and any(isinstance(e, BaseException) for e in v)
        ]
        return str(exc), holders, held

    text, holders, held = asyncio.run(main())
    assert text.startswith("Multiple exceptions: " if addresses == 2 else "[Errno 111]"), text
    assert "list" not in holders, holders
    assert held == []
