"""The asyncio client's own socket transport on selector loops (asyncio's default on
Linux, and a subclass of it), for a connection without TLS when the accelerator is built.

asyncio's _SelectorSocketTransport runs Python for every read (``_read_ready`` and
``_read_ready__get_buffer``: their checks, ``get_buffer``, ``recv_into``,
``buffer_updated``) and every write (``write``'s checks, ``send``). Here the loop's
reader callback and ``write`` are equeue/cext/rawsock.c's (RawSock): one C call each,
which hands the bytes to ClientConn's ``buffer_updated`` in C; with two or more such
transports on a loop, one ReadMux reads them all (equeue/client/readers.py). What is rare stays in
Python below and does what asyncio's transport does: a partial write queued and written
when the socket is writable (``add_writer``), with ``pause_writing``/``resume_writing``
at the same water marks (64 KiB / 16 KiB); the end of input → ``eof_received`` and
``close()``; a read or write error, or an exception of the protocol, → the loop's
exception handler (an OSError: logged at debug level only, in debug mode) and
``connection_lost(exc)``; ``close()`` and ``abort()`` → ``connection_lost`` in the next
loop turn, then the socket closed (once). uvloop, TLS and the pure-Python client keep
asyncio's transport (``usable``).

asyncio.Transport's other methods are here with asyncio's semantics (3.11's
_SelectorSocketTransport; tests/test_client_rawconn_interface.py runs each against it on a
socketpair), though nothing of the client calls them (it uses ``write``, ``abort`` and
``get_extra_info``): ``pause_reading``/``resume_reading`` (the reader removed and added
again), ``writelines`` (the bytes joined, one ``write``), ``write_eof`` (SHUT_WR once
nothing is queued; a later ``write`` raises RuntimeError) and ``can_write_eof`` (True),
``set_protocol`` (a protocol that is no BufferedProtocol is read in Python with
``data_received``, as asyncio reads one). One difference: a ``resume_reading`` after the
end of input does not read the socket again (asyncio's would call ``eof_received`` a
second time). RawTransport is no subclass of asyncio.Transport (a C base: no layout of
both) and has no "unclosed transport" ResourceWarning in ``__del__`` (the socket's own
still comes)."""

from __future__ import annotations

import asyncio
import logging
import socket
from asyncio.selector_events import BaseSelectorEventLoop
from asyncio.trsock import TransportSocket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from equeue.client import readers
from equeue.client.url import Endpoint
from equeue.protocol.plainsend import conn_type, raw_sock_type

if TYPE_CHECKING:

    class RawSock:  # equeue/cext/rawsock.c
        protocol: Any
        fd: int
        closing: int
        queued: int
        stream: int

        def read_ready(self) -> None: ...
        def write(self, data: bytes | bytearray | memoryview) -> None: ...

else:
    # (without the accelerator RawTransport is defined on object and never used)
    RawSock = object if raw_sock_type is None else raw_sock_type

log = logging.getLogger("asyncio")  # (where asyncio's transports log theirs)

HIGH_WATER = 64 * 1024  # asyncio's FlowControlMixin defaults
LOW_WATER = HIGH_WATER // 4
MAX_READ = 256 * 1024  # asyncio's max_size: one data_received's most


def usable(loop: asyncio.AbstractEventLoop, endpoint: Endpoint, protocol: object) -> bool:
    """Whether a connection to ``endpoint`` on ``loop`` takes this transport."""
    return (
        RawSock is not object
        and endpoint.ssl_context is None
        and endpoint.kind in ("unix", "tcp")
        and isinstance(loop, BaseSelectorEventLoop)
        and conn_type is not None
        and isinstance(protocol, conn_type)
    )


class RawTransport(RawSock):
    """A connected non-blocking socket's transport (asyncio.Transport's methods)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: Any) -> None:
        self.fd = sock.fileno()
        self.set_protocol(protocol)
        self._loop = loop
        self._sock = sock
        self._extra: dict[str, Any] = {"socket": TransportSocket(sock)}  # (asyncio's)
        try:
            self._extra["sockname"] = sock.getsockname()
        except OSError:
            self._extra["sockname"] = None
        try:
            self._extra["peername"] = sock.getpeername()
        except OSError:
            self._extra["peername"] = None
        self._wbuf = bytearray()
        self._high = HIGH_WATER
        self._low = LOW_WATER
        self._paused = False
        self._lost = False
        self._reading = False  # (whether readers has it)
        self._reading_paused = False  # pause_reading's
        self._input_ended = False
        self._eof_written = False

    def start(self) -> None:
        """connection_made, then reads (asyncio's order; not if connection_made paused
        them)."""
        self.protocol.connection_made(self)
        self._start_reading()

    # --- asyncio.Transport's methods -----------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return bool(self.closing)

    def is_reading(self) -> bool:
        return not self.closing and not self._reading_paused

    def pause_reading(self) -> None:
        if not self.is_reading():
            return
        self._reading_paused = True
        self._stop_reading()
        if self._loop.get_debug():
            log.debug("%r pauses reading", self)

    def resume_reading(self) -> None:
        if self.closing or not self._reading_paused:
            return
        self._reading_paused = False
        self._start_reading()
        if self._loop.get_debug():
            log.debug("%r resumes reading", self)

    def get_protocol(self) -> Any:
        return self.protocol

    def set_protocol(self, protocol: Any) -> None:
        # (ClientConn is a BufferedProtocol: the C read's own path)
        self.stream = int(not isinstance(protocol, asyncio.BufferedProtocol))
        self.protocol = protocol

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))  # (asyncio 3.11's WriteTransport.writelines)

    def write_eof(self) -> None:
        if self.closing or self._eof_written:
            return
        self._eof_written = True
        self.queued = 1  # every write now takes _write_slow, which refuses it
        if not self._wbuf:
            self._sock.shutdown(socket.SHUT_WR)

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return len(self._wbuf)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = HIGH_WATER if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = 1
        self._stop_reading()
        if not self._wbuf:
            self._lost = True
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        self._force_close(None)

    # --- the rare paths of rawsock.c ------------------------------------------

    def _write_slow(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"data argument must be a bytes-like object, not {type(data).__name__!r}"
            )
        if self._eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._lost or self.fd < 0:
            return  # (asyncio's: dropped once the connection is lost)
        if not data:
            return
        if not self._wbuf:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._fatal(exc, "Fatal write error on socket transport")
                return
            if sent == len(data):
                return
            self._write_rest(data, sent)
            return
        self._wbuf += data
        self._maybe_pause()

    def _write_rest(self, data: bytes | bytearray | memoryview, sent: int) -> None:
        self._wbuf += memoryview(data)[sent:]
        self.queued = 1
        self._loop.add_writer(self.fd, self._write_ready)
        self._maybe_pause()

    def _write_ready(self) -> None:
        if self._lost or self.fd < 0:
            return
        try:
            sent = self._sock.send(self._wbuf)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.remove_writer(self.fd)
            self._wbuf.clear()
            self.queued = 0
            self._fatal(exc, "Fatal write error on socket transport")
            return
        del self._wbuf[:sent]
        self._maybe_resume()
        if not self._wbuf:
            self._loop.remove_writer(self.fd)
            self.queued = int(self._eof_written)
            if self.closing:
                self._lost = True
                self._connection_lost(None)
            elif self._eof_written:
                self._sock.shutdown(socket.SHUT_WR)

    def _maybe_pause(self) -> None:
        if len(self._wbuf) > self._high and not self._paused:
            self._paused = True
            self._protocol_call(self.protocol.pause_writing, "pause_writing")

    def _maybe_resume(self) -> None:
        if self._paused and len(self._wbuf) <= self._low:
            self._paused = False
            self._protocol_call(self.protocol.resume_writing, "resume_writing")

    def _protocol_call(self, method: Callable[[], object], name: str) -> None:
        try:
            method()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._loop.call_exception_handler(
                {
                    "message": f"protocol.{name}() failed",
                    "exception": exc,
                    "transport": self,
                    "protocol": self.protocol,
                }
            )

    def _read_data(self) -> None:
        """A read for a protocol that is no BufferedProtocol (rawsock.c calls it)."""
        try:
            data = self._sock.recv(MAX_READ)
        except (BlockingIOError, InterruptedError):
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal(exc, "Fatal read error on socket transport")
            return
        if not data:
            self._eof()
            return
        try:
            self.protocol.data_received(data)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal(exc, "Fatal error: protocol.data_received() call failed.")

    def _eof(self) -> None:
        self._input_ended = True
        try:
            keep_open = self.protocol.eof_received()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal(exc, "Fatal error: protocol.eof_received() call failed.")
            return
        if keep_open:
            self._stop_reading()
        else:
            self.close()

    def _fatal(self, exc: BaseException, message: str) -> None:
        if isinstance(exc, OSError):
            if self._loop.get_debug():
                log.debug("%r: %s", self, message, exc_info=True)
        else:
            self._loop.call_exception_handler(
                {
                    "message": message,
                    "exception": exc,
                    "transport": self,
                    "protocol": self.protocol,
                }
            )
        self._force_close(exc)

    def _force_close(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        if self._wbuf:
            self._wbuf.clear()
            self._loop.remove_writer(self.fd)
            self.queued = 0
        if not self.closing:
            self.closing = 1
            self._stop_reading()
        self._lost = True
        self._loop.call_soon(self._connection_lost, exc)

    def _start_reading(self) -> None:
        if not self._reading and self.is_reading() and not self._input_ended:
            readers.start(self._loop, self)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            readers.stop(self._loop, self)

    def _connection_lost(self, exc: BaseException | None) -> None:
        try:
            self.protocol.connection_lost(exc)
        finally:
            self._sock.close()  # (the one close of the fd)
            self.fd = -1
            self.protocol = None

    def __repr__(self) -> str:
        state = "closed" if self.fd < 0 else "closing" if self.closing else "open"
        return f"<equeue RawTransport fd={self.fd} {state}>"


async def open_connection(
    loop: asyncio.AbstractEventLoop, endpoint: Endpoint, protocol: Any
) -> None:
    """Connect a socket of its own to ``endpoint`` (``usable`` said yes), and start its
    transport: the protocol's connection_made, then reads. A failed connect raises as
    asyncio's create_connection does, its socket closed."""
    if endpoint.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, endpoint.path)
        except BaseException:
            sock.close()
            raise
    else:
        sock = await _tcp(loop, endpoint.host, endpoint.port)
    try:
        RawTransport(loop, sock, protocol).start()
    except BaseException:  # (connection_made raised: no transport closes it; once is safe)
        sock.close()
        raise


async def _tcp(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """Each address of ``host`` in turn, as create_connection tries them (no happy
    eyeballs: the client does not ask for it); TCP_NODELAY set, as asyncio sets it."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError("getaddrinfo() returned empty list")
    errors: list[OSError] = []
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    try:
        if len(errors) == 1 or len({str(e) for e in errors}) == 1:
            raise errors[0]
        raise OSError("Multiple exceptions: {}".format(", ".join(str(e) for e in errors)))
    finally:
        # The raised exception's traceback holds this frame, whose list holds it (or
        # the ones it names): a cycle per failed connect, freed only by the cyclic GC.
        # Emptied here, as asyncio's create_connection drops its list.
        errors.clear()
