"""The rest of asyncio.Transport on the asyncio client's own transport
(equeue/client/rawconn.py: RawTransport): pause_reading/resume_reading, writelines,
write_eof/can_write_eof and set_protocol, each run on a socketpair against asyncio's
own _SelectorSocketTransport with the same steps, and the same outcome asked of both.
Nothing of the client calls them; a transport that says it is one must honour them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest
from test_client_rawconn import _drain, _pair, _read_until, _Recording

from equeue import speedups

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")

BOTH = pytest.mark.parametrize("own", [True, False], ids=["RawTransport", "asyncio"])


class _Received(_Recording):
    """_Recording that keeps the bytes and the end of input."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.eof = 0

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        self.data += self.buffer[:nbytes]

    def eof_received(self) -> bool:
        self.eof += 1
        return True  # (kept open: the test writes after it)


class _Stream(asyncio.Protocol):
    """A plain Protocol (data_received, no get_buffer)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = 0
        self.lost: list[BaseException | None] = []

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> None:
        self.eof += 1  # (None: the transport closes)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)


async def _until(done: Callable[[], object]) -> None:
    for _ in range(5000):  # (bounded: 1 ms turns)
        if done():
            return
        await asyncio.sleep(0.001)


async def _turns() -> None:
    """Loop turns enough for a reader that is still registered to read what is there (a
    wrong transport fails the test here; a right one passes however slow the machine)."""
    for _ in range(20):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)


async def _close(transport: Any, far: socket.socket) -> None:
    transport.close()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    far.close()


@BOTH
def test_pause_reading_stops_reads_until_resume_reading(own: bool) -> None:
    """Paused: is_reading() False and bytes sent meanwhile are not read; a second pause
    is a no-op; resume_reading reads them; after close() neither does anything."""

    async def main() -> list[object]:
        protocol = _Received()
        transport, far = await _pair(own, protocol)
        seen: list[object] = [transport.is_reading()]
        far.send(b"one")
        await _until(lambda: protocol.data)
        transport.pause_reading()
        transport.pause_reading()
        seen.append(transport.is_reading())
        far.send(b"two")
        await _turns()
        seen.append(bytes(protocol.data))
        transport.resume_reading()
        transport.resume_reading()
        seen.append(transport.is_reading())
        await _until(lambda: len(protocol.data) >= 6)
        seen.append(bytes(protocol.data))
        transport.close()
        transport.resume_reading()
        transport.pause_reading()
        seen.append(transport.is_reading())
        await _close(transport, far)
        return seen

    assert asyncio.run(main()) == [True, False, b"one", True, b"onetwo", False]


class _PausesAtOnce(_Received):
    def connection_made(self, transport: Any) -> None:
        transport.pause_reading()


@BOTH
def test_reading_paused_in_connection_made_starts_only_at_resume(own: bool) -> None:
    async def main() -> tuple[bool, bytes, bytes]:
        protocol = _PausesAtOnce()
        transport, far = await _pair(own, protocol)
        far.send(b"early")
        await _turns()
        paused = transport.is_reading(), bytes(protocol.data)
        transport.resume_reading()
        await _until(lambda: protocol.data)
        await _close(transport, far)
        return (*paused, bytes(protocol.data))

    assert asyncio.run(main()) == (False, b"", b"early")


@BOTH
def test_writelines_writes_the_pieces_in_order(own: bool) -> None:
    """Bytes, bytearray and memoryview pieces, behind a queued 1 MB write too; a piece
    that is no bytes-like object raises TypeError and writes nothing."""

    async def main() -> tuple[bytes, str]:
        transport, far = await _pair(own, _Received())
        got = bytearray()
        transport.writelines([b"ab", bytearray(b"cd"), memoryview(b"ef")])
        transport.writelines([b"A" * 1_000_000])
        transport.writelines(iter([b"gh", b"ij"]))
        with pytest.raises(TypeError) as raised:
            transport.writelines([b"kl", "mn"])
        await _read_until(far, got, 1_000_010)
        await _turns()
        _drain(far, got)
        await _close(transport, far)
        return bytes(got), str(raised.value)

    got, error = asyncio.run(main())
    assert got == b"abcdef" + b"A" * 1_000_000 + b"ghij"
    assert error == "sequence item 1: expected a bytes-like object, str found"


async def _read_to_end(far: socket.socket) -> tuple[bytes, bool]:
    """What the peer reads, and whether it met the end of the stream."""
    got = bytearray()
    for _ in range(5000):
        try:
            chunk = far.recv(1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.001)
            continue
        if not chunk:
            return bytes(got), True
        got += chunk
    return bytes(got), False


@BOTH
@pytest.mark.parametrize("queued", [False, True], ids=["sent", "queued"])
def test_write_eof_ends_the_stream_after_what_was_written(own: bool, queued: bool) -> None:
    """write_eof: the peer reads every byte written before it (sent, or 1 MB still queued
    then), then the end; a write after it raises RuntimeError, a second write_eof is a
    no-op; the transport still reads, and is not closing."""

    async def main() -> list[object]:
        protocol = _Received()
        transport, far = await _pair(own, protocol)
        before = b"B" * (1_000_000 if queued else 10)
        transport.write(before)
        seen: list[object] = [transport.can_write_eof(), transport.get_write_buffer_size() > 0]
        transport.write_eof()
        transport.write_eof()
        with pytest.raises(RuntimeError) as raised:
            transport.write(b"after")
        with pytest.raises(RuntimeError):
            transport.writelines([b"after"])
        seen.append(str(raised.value))
        got, ended = await _read_to_end(far)
        seen += [got == before, ended, transport.is_closing()]
        far.send(b"back")
        await _until(lambda: protocol.data)
        seen.append(bytes(protocol.data))
        await _close(transport, far)
        return seen

    assert asyncio.run(main()) == [
        True,
        queued,
        "Cannot call write() after write_eof()",
        True,
        True,
        False,
        b"back",
    ]


@BOTH
def test_write_eof_after_close_does_nothing(own: bool) -> None:
    async def main() -> bytes:
        transport, far = await _pair(own, _Received())
        transport.write(b"x")
        transport.close()
        transport.write_eof()
        await asyncio.sleep(0)
        got, _ = await _read_to_end(far)
        far.close()
        return got

    assert asyncio.run(main()) == b"x"


@BOTH
def test_set_protocol_hands_the_next_reads_to_the_new_protocol(own: bool) -> None:
    """A BufferedProtocol swapped for another, then for a plain Protocol (read with
    data_received, as asyncio reads one): each gets what comes after it was set, the
    last also the end of input (eof_received returning None: closed, connection_lost)."""

    async def main() -> list[object]:
        first, second, third = _Received(), _Received(), _Stream()
        transport, far = await _pair(own, first)
        far.send(b"1")
        await _until(lambda: first.data)
        transport.set_protocol(second)
        seen: list[object] = [transport.get_protocol() is second]
        far.send(b"2")
        await _until(lambda: second.data)
        transport.set_protocol(third)
        await asyncio.get_running_loop().sock_sendall(far, b"3" * 300_000)
        await _until(lambda: len(third.data) >= 300_000)
        far.shutdown(socket.SHUT_WR)
        await _until(lambda: third.lost)
        seen += [bytes(first.data), bytes(second.data), len(third.data), third.eof, third.lost]
        seen += [first.lost, second.lost, transport.is_closing()]
        far.close()
        return seen

    assert asyncio.run(main()) == [True, b"1", b"2", 300_000, 1, [None], [], [], True]


class _FailingStream(_Stream):
    def data_received(self, data: bytes) -> None:
        raise ValueError("bad bytes")


@BOTH
def test_a_failing_data_received_is_reported_as_by_asyncios_transport(own: bool) -> None:
    async def main() -> tuple[list[str], list[BaseException | None]]:
        seen: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, c: seen.append(c))
        protocol = _FailingStream()
        transport, far = await _pair(own, _Received())
        transport.set_protocol(protocol)
        far.send(b"x")
        await _until(lambda: protocol.lost)
        far.close()
        return [c["message"] for c in seen], protocol.lost

    messages, lost = asyncio.run(main())
    assert messages == ["Fatal error: protocol.data_received() call failed."]
    assert len(lost) == 1 and isinstance(lost[0], ValueError)
