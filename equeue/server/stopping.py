"""A draining broker's last frame on each connection (protocol version 6, reviewk F9):
BrokerStoppingError with request id 0, after every request it served is answered, so
that a client tells the requests it never served (not stored: unsent) from those it
may have (unanswered). docs/protocol.md, "Stopping"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import BrokerStoppingError
from equeue.protocol.frames import CONNECTION_REQUEST_ID, STOP_NOTICE_VERSION

if TYPE_CHECKING:
    from equeue.server.connection import Connection


def stop(connection: Connection) -> None:
    """Close ``connection``, with a last frame saying that no request of it left
    unanswered was served (BrokerStoppingError, request id 0: the client reports those
    sends unsent). Said only when it is true: reading is paused (serve.py _drain), what
    was served is answered (in_flight 0; the frames read and not served, the backlog and
    a frame begun, are dropped), the hello was accepted and a TLS handshake is done (a
    client could not read it before); to a client welcomed with protocol version 6 or
    later (an older one was never sent it: a raw version-1 client of the tests failed on
    an id-0 frame there)."""
    if connection.closed:
        return
    if (
        connection._hello is None
        and connection._tls is None
        and not connection.in_flight
        and connection.version >= STOP_NOTICE_VERSION
    ):
        connection._backlog = []
        connection._answer_error(
            CONNECTION_REQUEST_ID,
            BrokerStoppingError(
                f"{connection.where}: the broker is stopping; it served none of this "
                "connection's requests that it has not answered (none of them was "
                "stored: safe to send again)"
            ),
            error=False,
        )
    connection.close()
