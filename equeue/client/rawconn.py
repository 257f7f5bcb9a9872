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

Not all of asyncio.Transport: RawTransport is no subclass of it and has no
``pause_reading``/``resume_reading``, ``writelines``, ``write_eof``/``can_write_eof`` or
``set_protocol``, and no "unclosed transport" ResourceWarning in ``__del__`` (the
socket's own still comes). Nothing calls them: the client uses ``write``, ``abort``
and ``get_extra_info`` (equeue/client/aio.py, loops.py), ClientConn (clientconn.c)
``write``; it never stops reading (answers are read as they come), never half-closes
and never swaps the protocol. A change that needs one adds it here first."""

from __future__ import annotations

import asyncio
import logging
import socket
from asyncio.selector_events import BaseSelectorEventLoop
from asyncio.trsock import TransportSocket
from collections.abc import Callable
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

        def read_ready(self) -> None: ...
        def write(self, data: bytes | bytearray | memoryview) -> None: ...

else:
    # (without the accelerator RawTransport is defined on object and never used)
    RawSock = object if raw_sock_type is None else raw_sock_type

log = logging.getLogger("asyncio")  # (where asyncio's transports log theirs)

HIGH_WATER = 64 * 1024  # asyncio's FlowControlMixin defaults
LOW_WATER = HIGH_WATER // 4


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
        self.protocol = protocol
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
        self._reading = False

    def start(self) -> None:
        """connection_made, then reads (asyncio's order)."""
        self.protocol.connection_made(self)
        if not self.closing:
            readers.start(self._loop, self)
            self._reading = True

    # --- asyncio.Transport's methods -----------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return bool(self.closing)

    def is_reading(self) -> bool:
        return self._reading and not self.closing

    def get_protocol(self) -> Any:
        return self.protocol

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
            self.queued = 0
            if self.closing:
                self._lost = True
                self._connection_lost(None)

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

    def _eof(self) -> None:
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
