"""How a request of the asyncio client (equeue.client.aio) ends early: a long poll whose
caller was cancelled is given up (cancel_pull, protocol version 6: reviewk F4), a
write that finds the broker gone reads what the broker wrote before it closed (a
stopping broker's last frame says which requests it never served: reviewk F9), and a
request whose answer could not be given to every caller is left to the connection's end
(still_waiting: review15 R15-3). The sync client's are in endings.py."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

from equeue.client.coalesce import Answer
from equeue.client.connect import RECV_BYTES
from equeue.protocol.frames import CANCEL_PULL_VERSION

if TYPE_CHECKING:
    from equeue.client.aio import _Protocol


def cancel_pull(protocol: _Protocol, request_id: int) -> None:
    """The caller of the long poll ``request_id`` gave up on it: the broker (protocol
    version 6) is asked to answer it now, empty (cancel_pull), so that its place under
    max_in_flight comes back within a round trip, not at its wait's end (reviewk F4).
    Both answers are dropped. An older broker is not asked: the place comes back when
    the pull's wait ends, as before (docs/client.md)."""
    encoder = protocol.encoder
    if (
        protocol.closed
        or request_id not in protocol.pending
        or encoder is None
        or encoder.version < CANCEL_PULL_VERSION
    ):
        return
    cancel_id = protocol.next_id()
    frame = encoder.frame(cancel_id, "cancel_pull", {"request_id": request_id})
    future: asyncio.Future[Any] = protocol.loop.create_future()
    future.add_done_callback(_retrieved)  # (failed with the connection: no one awaits it)
    # Its answer gives a place back, as every answer does (answers()): taken here, though
    # the broker does not count it (it may go below 0 for that round trip)
    protocol.free -= 1
    protocol.send(cancel_id, frame, (future, None, time.monotonic() + protocol.timeout))


def read_rest(protocol: _Protocol) -> None:
    """What the broker wrote before it closed, still in the socket when a write found
    it gone (EPIPE, ECONNRESET: the transport ends without reading on): a stopping
    broker's last frame among it (BrokerStoppingError) says which requests it never
    served, so they are unsent, not unanswered. Read without blocking; not under TLS
    (records, read by the transport only)."""
    transport = protocol.transport
    if transport is None or transport.get_extra_info("ssl_object") is not None:
        return
    sock = transport.get_extra_info("socket")
    try:
        fd = sock.fileno() if sock is not None else -1
    except (OSError, ValueError):
        return
    while fd >= 0 and not protocol.closed:
        try:
            data = os.read(fd, RECV_BYTES)
        except OSError:  # nothing more (EAGAIN), or the reset after the last byte
            return
        if not data:
            return
        protocol.data_received(data)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def still_waiting(target: asyncio.Future[Any] | Answer) -> bool:
    """Whether a caller of a request's ``target`` (its future, or a coalesced group's
    Answer) still waits: the request, taken from ``pending`` for its answer, goes back
    there when giving the answer raised, so that the connection's end answers that caller
    with ConnectionLostError (fail() skips the futures already done)."""
    if isinstance(target, Answer):
        return not all(future.done() for future in target.futures)
    return not target.done()
