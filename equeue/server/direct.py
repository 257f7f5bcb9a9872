"""Which connections get their answers sent to their socket by C.

release_frames (cext/release.c, answerwrite.c) sends a flush's answers, and the send lane
(cext/sendlane.c) a plain send's answer where there is no group commit (``--flush async``
or ``os``), with send(2) on the connection's socket when its transport is not closing and
has nothing queued, instead of ``transport.write`` (uvloop's write was ~1.4 k
instructions of the broker loop's ~11.8 k a durable send, issue 23). Only where the bytes
on the socket are the answer itself: a plain Unix or TCP transport of uvloop or asyncio's
selector loop, never TLS (its socket carries records, not frames) nor a transport this
module does not know.
"""

from __future__ import annotations

import asyncio

# (module, class) of the transports whose socket takes the answer's bytes as they are
PLAIN_TRANSPORTS = frozenset(
    {
        ("uvloop.loop", "UnixTransport"),
        ("uvloop.loop", "TCPTransport"),
        ("asyncio.selector_events", "_SelectorSocketTransport"),
    }
)


def direct_fd(transport: asyncio.BaseTransport) -> int:
    """The socket's fd to send answers on directly, or -1: answers go through the transport."""
    kind = type(transport)
    if (kind.__module__, kind.__qualname__) not in PLAIN_TRANSPORTS:
        return -1
    if (
        transport.get_extra_info("sslcontext") is not None
        or transport.get_extra_info("ssl_object") is not None
    ):
        return -1
    sock = transport.get_extra_info("socket")
    try:
        fd = sock.fileno() if sock is not None else -1
    except (OSError, ValueError):  # (closed already)
        return -1
    return fd if isinstance(fd, int) and fd >= 0 else -1
