"""The broker's answer sent by C (cext/answerwrite.c) off its common path: a short write,
a full socket (EAGAIN), a peer that has gone (EPIPE), a failing or odd transport, and a
transport class changed after its methods were cached. Reached through release_frames
(a flush's durable answers) and the send lane (a plain send under --flush async), with
fake connections and transports over a real socketpair: over a real broker these paths
are too rare to reach on purpose (a full socket while the transport's buffer is empty)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_dir

from equeue import speedups
from equeue.protocol.frames import FRAME_HEADER, encode
from equeue.protocol.handshake import Hello
from equeue.server.config import ServerConfig
from equeue.server.connection import Connection
from equeue.server.handlers import Frame
from equeue.server.serve import Broker

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="answer_write is C")
ROOT = Path(__file__).resolve().parent.parent


class Peer:
    """The Connection slots release_frames reads, and the socket's fd."""

    __slots__ = ("_batching", "_ended", "_fd", "_out", "closed", "in_flight", "transport")

    def __init__(self, transport: object, fd: int) -> None:
        self._out: list[bytes] = []
        self._ended = self._batching = self.closed = False
        self.transport, self.in_flight, self._fd = transport, 1, fd


class SlotTransport:
    """No __dict__: its is_closing and get_write_buffer_size are cached by C."""

    __slots__ = ("aborted", "fail_write", "queued", "written")

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = 0
        self.queued: Any = 0
        self.fail_write = False

    def is_closing(self) -> bool:
        return self.aborted > 0

    def get_write_buffer_size(self) -> Any:
        if isinstance(self.queued, Exception):
            raise self.queued
        return self.queued

    def write(self, data: bytes) -> None:
        if self.fail_write:
            raise RuntimeError("the transport refuses the write")
        self.written.append(bytes(data))

    def abort(self) -> None:
        self.aborted += 1


class DictTransport(SlotTransport):
    """With a __dict__: its methods called by name each time."""

    __slots__ = ("__dict__",)


class Counters:
    bytes_out = 0


@pytest.fixture(name="pair")
def _pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.setblocking(False)
    b.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _direct() -> int:
    assert speedups.SPEEDUPS is not None
    return int(speedups.SPEEDUPS.answers_written_directly())


def _release(peer: Peer, *frames: Frame) -> list[BaseException]:
    """release_frames of frames to peer (in flight as many); the exceptions failed() got."""
    assert speedups.SPEEDUPS is not None
    failures: list[BaseException] = []
    peer.in_flight = len(frames)
    batch = [(peer, i + 1, f) for i, f in enumerate(frames)]

    def other(*args: object) -> None:
        raise AssertionError(f"other() called: {args[1:]}")

    def failed(connection: object, error: BaseException) -> None:
        failures.append(error)

    assert speedups.SPEEDUPS.release_frames(batch, Frame, Counters(), other, failed)
    assert peer.in_flight == 0
    return failures


def _drain(sock: socket.socket) -> bytes:
    got = b""
    for _ in range(100_000):
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return got
        if not data:
            return got
        got += data
    raise AssertionError("the socket never ran dry")


def _fill(sock: socket.socket) -> None:
    for _ in range(100_000):
        try:
            sock.send(b"x" * 512)
        except BlockingIOError:
            return
    raise AssertionError("the socket never filled")


@pytest.fixture(name="transport", params=[SlotTransport, DictTransport])
def _transport(request: pytest.FixtureRequest) -> SlotTransport:
    kind: type[SlotTransport] = request.param
    return kind()


def test_a_whole_answer_is_sent_and_counted_per_answer(
    pair: tuple[socket.socket, socket.socket], transport: SlotTransport
) -> None:
    a, b = pair
    frames = [Frame(b"\x00\x00\x00\x01%c" % (65 + i)) for i in range(3)]
    before = _direct()
    assert _release(Peer(transport, a.fileno()), *frames) == []
    assert _drain(b) == b"".join(frames) and transport.written == []
    assert _direct() - before == 3  # three answers in one write


def test_a_short_write_leaves_only_the_rest_to_the_transport(
    pair: tuple[socket.socket, socket.socket], transport: SlotTransport
) -> None:
    a, b = pair
    frame = Frame(bytes(range(256)) * 1000)  # far more than the socket takes
    before = _direct()
    assert _release(Peer(transport, a.fileno()), frame) == []
    on_socket = _drain(b)
    assert 0 < len(on_socket) < len(frame)
    assert len(transport.written) == 1  # the rest, once
    assert on_socket + transport.written[0] == frame
    assert _direct() == before


def test_a_full_socket_leaves_the_whole_answer_to_the_transport(
    pair: tuple[socket.socket, socket.socket], transport: SlotTransport
) -> None:
    a, b = pair
    _fill(a)
    frame = Frame(b"\x00\x00\x00\x03abc")
    before = _direct()
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert transport.written == [frame]
    assert set(_drain(b)) == {ord("x")}  # nothing of the answer's on the socket
    assert _direct() == before


def test_a_peer_gone_leaves_the_whole_answer_to_the_transport(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.close()  # EPIPE on a's next send (MSG_NOSIGNAL: no SIGPIPE)
    transport = SlotTransport()
    frame = Frame(b"\x00\x00\x00\x03abc")
    before = _direct()
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert transport.written == [frame]  # the transport's write meets EPIPE and closes
    assert _direct() == before


def test_a_failed_write_of_the_rest_aborts_the_transport(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    transport = SlotTransport()
    transport.fail_write = True
    failures = _release(Peer(transport, a.fileno()), Frame(b"\x01" * 256_000))
    assert 0 < len(_drain(b)) < 256_000  # a cut frame on the wire
    assert transport.aborted == 1  # so the connection is dropped, not left open
    assert [type(e) for e in failures] == [RuntimeError]


def test_a_failed_whole_write_does_not_abort(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _b = pair
    _fill(a)
    transport = SlotTransport()
    transport.fail_write = True
    failures = _release(Peer(transport, a.fileno()), Frame(b"\x00\x00\x00\x01a"))
    assert transport.aborted == 0  # nothing of it on the wire: the transport decides
    assert [type(e) for e in failures] == [RuntimeError]


@pytest.mark.parametrize("queued", [RuntimeError("no size"), 1 << 70, -(1 << 70), "0", None, 5])
def test_an_odd_write_buffer_size_leaves_the_answer_to_the_transport(
    pair: tuple[socket.socket, socket.socket], transport: SlotTransport, queued: object
) -> None:
    a, b = pair
    transport.queued = queued
    frame = Frame(b"\x00\x00\x00\x03abc")
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert transport.written == [frame] and _drain(b) == b""


def test_a_method_replaced_on_the_class_is_seen(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair

    class Changing(SlotTransport):
        __slots__ = ()

    transport = Changing()
    frame = Frame(b"\x00\x00\x00\x03abc")
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert _drain(b) == frame  # sent directly: Changing's methods looked up (cached)
    Changing.is_closing = lambda self: True  # type: ignore[method-assign]
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert _drain(b) == b"" and transport.written == []  # closing: nothing written
    Changing.get_write_buffer_size = lambda self: 1  # type: ignore[method-assign]
    Changing.is_closing = lambda self: False  # type: ignore[method-assign]
    assert _release(Peer(transport, a.fileno()), frame) == []
    assert _drain(b) == b"" and transport.written == [frame]  # queued: through write


# --- the send lane's answer (--flush async) ---------------------------------


class LaneTransport(SlotTransport):
    """A Connection's transport: the rest of the methods it calls do nothing."""

    __slots__ = ("__dict__",)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def close(self) -> None:
        self.aborted += 1

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


async def _lane_answers(directory: Path, fill: bool, gone: bool) -> tuple[bytes, list[bytes], int]:
    broker = Broker(directory, ServerConfig(flush="async"))
    await broker.start()
    a, b = socket.socketpair()
    connection = Connection(broker, "test", 1)
    try:
        a.setblocking(False)
        b.setblocking(False)
        transport = LaneTransport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        assert "buffer_updated" in connection.__dict__  # the C lane reads
        for read in (encode(Hello(client="t").pack()),):
            view = connection.get_buffer(len(read))
            view[: len(read)] = read
            connection.buffer_updated(len(read))
        _drain(b)
        transport.written.clear()
        connection._fd = a.fileno()
        if fill:
            _fill(a)
        if gone:
            b.close()
        before = _direct()
        read = encode([7, "send", {"topic": "t", "body": b"body"}])
        view = connection.get_buffer(len(read))
        view[: len(read)] = read
        connection.buffer_updated(len(read))
        got = b"" if gone else _drain(b)
        return got, transport.written, _direct() - before
    finally:
        if not connection.closed:
            connection.connection_lost(None)  # (else the drain waits for it)
        a.close()
        b.close()
        await broker._drain()


@pytest.mark.parametrize("case", ["direct", "full", "gone"])
def test_the_send_lane_answer(case: str) -> None:
    directory = short_dir()
    try:
        got, written, direct = asyncio.run(
            _lane_answers(directory / "s", fill=case == "full", gone=case == "gone")
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if case == "direct":
        assert written == [] and direct == 1
        assert len(got) > FRAME_HEADER.size
    else:
        assert len(written) == 1 and direct == 0  # the whole answer through the transport
        assert len(written[0]) == FRAME_HEADER.size + FRAME_HEADER.unpack_from(written[0])[0]
        assert set(got) <= {ord("x")}


# --- a build without MSG_NOSIGNAL -------------------------------------------


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("source", ["answerwrite.c", "rawsock.c"])
def test_builds_where_the_headers_lack_msg_nosignal(tmp_path: Path, source: str) -> None:
    shim = tmp_path / "sys"
    shim.mkdir()
    # the system's header with MSG_NOSIGNAL taken away (as on older macOS SDKs): glibc's
    # enum member renamed by a macro before it is read, its own #define dropped after
    (shim / "socket.h").write_text(
        "#define MSG_NOSIGNAL MSG_NOSIGNAL_hidden\n#include_next <sys/socket.h>\n"
        "#undef MSG_NOSIGNAL\n"
    )
    include = sysconfig.get_paths()["include"]
    run = subprocess.run(
        ["gcc", "-fsyntax-only", "-w", "-Werror=implicit-function-declaration", f"-I{tmp_path}",
         f"-I{include}", str(ROOT / "equeue" / "cext" / source)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
