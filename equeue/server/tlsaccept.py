"""A ``tls://`` connection's handshake, done by the broker after the accept (review g F3).

With ``create_server(ssl=...)`` the protocol sees a connection only once its handshake
is done: a peer stalled in it held an fd for asyncio's 60 s, counted by no
``max_connections`` and evictable by nobody. Here the listener is plain TCP and the
Connection is made, counted and given its hello timer at the accept; it then upgrades
its own transport (``loop.start_tls``). Until the handshake is done the Connection is
silent (no hello), so a full broker may close it for a new one (admission.py), and the
hello timer bounds handshake and hello together.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, cast

from equeue.errors import EQueueError
from equeue.protocol.frames import HELLO_MAX_FRAME_BYTES

if TYPE_CHECKING:
    from equeue.server.connection import Connection

log = logging.getLogger("equeue.server")

# Connections refused at their accept (a full broker) whose handshake still runs so that
# the refusal reaches the client in TLS; past this many at once, closed without one.
MAX_REFUSALS_IN_HANDSHAKE = 16


class _Early(asyncio.BufferedProtocol):
    """Takes what arrives between the handshake's end and the Connection taking the TLS
    transport (the SSL protocol reads on as soon as its handshake is done, before
    start_tls returns): the Connection's answers must never go to the raw socket."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.data = bytearray()
        self.ended = False
        self._buffer = memoryview(bytearray(1 << 16))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self._buffer[:nbytes]
        if len(self.data) > 4 * HELLO_MAX_FRAME_BYTES:  # (one loop turn's reads at most)
            self.conn.close()

    def eof_received(self) -> bool:
        self.ended = True
        return True  # the Connection decides, once it has the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.connection_lost(exc)


def _feed_early_bytes(conn: Connection, raw: asyncio.Transport) -> None:
    data, conn._tls_raw = bytes(conn._tls_raw), bytearray()
    if not data or conn.closed:
        return
    tls = raw.get_protocol()
    # (uvloop's SSLProtocol is no asyncio.BufferedProtocol subclass, but has its methods)
    if tls is conn or not hasattr(tls, "buffer_updated"):  # (start_tls did not run)
        conn.close()
        return
    tls = cast(asyncio.BufferedProtocol, tls)
    buffer = memoryview(tls.get_buffer(len(data)))
    if len(buffer) < len(data):  # (its buffer is 256 KiB: a ClientHello fits)
        conn.close()
        return
    buffer[: len(data)] = data
    tls.buffer_updated(len(data))


def accept_tls(conn: Connection, context: ssl.SSLContext, refusal: EQueueError | None) -> None:
    """Start conn's handshake; ``refusal`` (a full broker) is answered once it is done."""
    broker = conn.broker
    if refusal is not None:
        if broker.tls_refusals >= MAX_REFUSALS_IN_HANDSHAKE:
            conn._fatal(refusal)  # (still handshaking: closed without an answer)
            return
        broker.tls_refusals += 1
        broker.connections.discard(conn)  # refused: it holds no place
    conn._tls_task = broker.loop.create_task(_handshake(conn, context, refusal))


async def _handshake(
    conn: Connection, context: ssl.SSLContext, refusal: EQueueError | None
) -> None:
    broker = conn.broker
    raw = conn.transport
    assert raw is not None
    early = _Early(conn)
    # uvloop starts reading after connection_made (a pause there is undone): the first
    # bytes of the ClientHello may reach the Connection, which keeps them and pauses
    # (connection.py data_received). They go to the TLS protocol first: fed after
    # start_tls gives it the socket and before its resume_reading (called soon after).
    try:
        if conn.closed:  # (evicted, or timed out, before this first step)
            conn.connection_lost(None)
            return
        broker.loop.call_soon(_feed_early_bytes, conn, raw)
        try:
            upgraded = await broker.loop.start_tls(
                raw, early, context, server_side=True,
                ssl_handshake_timeout=broker.config.hello_timeout_ms / 1000,
            )  # fmt: skip
        except Exception as exc:  # (an SSLError, a reset, its timeout: the peer's doing)
            log.info("%s: TLS handshake failed: %s", conn.where, exc)
            upgraded = None
        if upgraded is None or conn.closed:  # failed, timed out, or closed meanwhile
            raw.abort()
            conn.connection_lost(None)
            return
        transport = upgraded
        conn._tls = None  # (from here on, answered and closed as any connection)
        conn.transport = transport
        transport.set_protocol(conn)
        transport.set_write_buffer_limits(high=broker.config.write_buffer_high)
        if refusal is not None:
            conn._fatal(refusal)
            return
        if early.data:
            conn.data_received(bytes(early.data))
        if early.ended and not conn.closed and not conn.eof_received():
            conn.close()
    finally:
        conn._tls_task = None
        if refusal is not None:
            broker.tls_refusals -= 1
