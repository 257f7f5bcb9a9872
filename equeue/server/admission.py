"""Admitting a connection: its hello (protocol version, token, client name) and room for
it in a full broker.

Each runs once per connection (take_hello until the hello is whole): out of
connection.py, which serves the requests that follow.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
from typing import TYPE_CHECKING

from equeue.errors import AuthenticationError, FrameTooLargeError, LimitExceededError, ProtocolError
from equeue.protocol.frames import (
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    HELLO_MAX_FRAME_BYTES,
    decode_body,
    encode,
)
from equeue.protocol.handshake import Hello, Welcome, choose_version

if TYPE_CHECKING:
    from equeue.server.connection import Connection

EVICT_AFTER_S = 1.0  # a full broker closes a peer silent this long for a new connection

# TCP keepalive on every accepted TCP and TLS connection: a peer that vanished without a
# FIN or RST (a network cut, a paused VM, a NAT that dropped the flow) is otherwise never
# noticed while nothing is written to it, and keeps its max_connections place and its held
# pulls until the broker restarts. First probe after 60 s idle, then every 10 s, the
# connection closed after 6 unanswered: a dead peer is gone within ~2 minutes, and a live
# idle one costs a 0-byte probe a minute. (Unix sockets need none: the kernel sees the
# peer's end.)
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 6


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """Turn TCP keepalive on for a TCP or TLS connection; anything else is left as it is."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),  # Linux names; macOS has TCP_KEEPALIVE
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:  # closed already (connection_lost follows), or a kernel without them
        pass


def refusal_of(conn: Connection) -> LimitExceededError | None:
    """Why a new connection is closed at once, if it is: a draining broker, or
    max_connections reached with no silent peer to close for it. The status socket's
    connections (statussock.py) are not counted: its own bound holds them."""
    broker = conn.broker
    if broker.draining:
        return LimitExceededError(f"{conn.where}: the broker is shutting down")
    limit = broker.config.max_connections
    if len(broker.connections) - len(broker.status_connections) > limit and (
        not evict_a_silent_peer(conn)
    ):
        return LimitExceededError(
            f"{conn.where}: the broker has {limit} connections already "
            f"(max_connections={limit}; equeue serve --max-connections)"
        )
    return None


def evict_a_silent_peer(conn: Connection) -> bool:
    """The broker is full: close the conn that has waited longest without a
    hello, if one has for EVICT_AFTER_S, to make room for this one. So peers that
    connect and say nothing cannot keep clients out (they are closed after
    hello_timeout_ms anyway)."""
    broker = conn.broker
    now = broker.loop.time()
    silent = [
        c
        for c in broker.connections
        if c is not conn and c._hello is not None and not c.closed
        and now - c.opened >= EVICT_AFTER_S
        and c not in broker.status_connections  # (its closing would make no room)
    ]  # fmt: skip
    if not silent:
        return False
    oldest = min(silent, key=lambda c: c.number)
    oldest._fatal(
        LimitExceededError(
            f"{oldest.where}: no hello after {now - oldest.opened:.1f} s and the broker is "
            f"full (max_connections={broker.config.max_connections}): closed to make room"
        )
    )
    broker.connections.discard(oldest)  # its place is this one's from now
    return True


def take_hello(conn: Connection, data: bytes | memoryview) -> bytes | None:
    """The bytes after the hello once it is whole and accepted, else None."""
    buffer = conn._hello
    assert buffer is not None
    buffer += data
    if len(buffer) < FRAME_HEADER_SIZE:
        return None
    (length,) = FRAME_HEADER.unpack_from(buffer, 0)
    if length > HELLO_MAX_FRAME_BYTES:
        raise FrameTooLargeError(
            f"{conn.where}: a hello frame of {length} bytes exceeds {HELLO_MAX_FRAME_BYTES} "
            "(the limit before the handshake)"
        )
    if length == 0:
        raise ProtocolError(f"{conn.where}: an empty frame (length 0)")
    end = FRAME_HEADER_SIZE + length
    if len(buffer) < end:
        return None
    hello = Hello.unpack(decode_body(bytes(buffer[FRAME_HEADER_SIZE:end]), conn.where), conn.where)
    rest = bytes(buffer[end:])
    conn._hello = None
    if conn._hello_timer is not None:
        conn._hello_timer.cancel()
        conn._hello_timer = None
    version = choose_version(hello.versions, conn.broker.welcome_versions)
    if version is None:
        raise ProtocolError(
            f"{conn.where}: the client speaks protocol versions {list(hello.versions)[:8]}, "
            f"this broker {list(conn.broker.welcome_versions)}"
        )
    token = conn.broker.token
    if token is not None:
        given = hello.token
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            what = "no token" if given is None else "a wrong token"
            conn._fatal(AuthenticationError(f"{conn.where}: the client gave {what}"))
            return None
    conn.client = hello.client
    conn.speak(version)
    if hello.client:  # logs name the client from here on
        conn.where += f" (client {hello.client!r})"
    welcome = encode(Welcome(version, conn.broker.server_name, conn.broker.limits).pack())
    shm = conn.broker.shm
    if hello.shm is not None and shm is not None:
        if rest:  # (the rings start after the welcome: refused before any is made)
            raise ProtocolError(
                f"{conn.where}: {len(rest)} bytes after a hello that asked for shared rings"
            )
        if shm.attach(conn, welcome, hello.shm):
            return b""
    conn._queue(welcome)
    return rest
