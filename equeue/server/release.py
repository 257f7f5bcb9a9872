"""Answers written outside a connection's read, for many connections at once.

release_durable: a group commit's flush (groupcommit.py) releases one answer to each of
many connections, written in the callback that got them, in C when it can
(cext/release.c), else answer by answer. write_later: answers made outside a read by
anything else (held pulls, a lone finish) leave in one loop callback for every connection
with some. connection.py's Connection reads and answers within a read; this is the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from equeue import speedups
from equeue.server.groupcommit import Entry
from equeue.server.handlers import Frame

if TYPE_CHECKING:
    from equeue.server.connection import Connection

log = logging.getLogger("equeue.server")

_per_loop = threading.local()  # a thread runs one event loop at a time

# (batch, Frame, counters, other, failed) -> whether it answered the batch (cext/release.c)
release_frames: Callable[[list[Entry], type, Any, Any, Any], bool] | None = (
    speedups.SPEEDUPS.release_frames if speedups.SPEEDUPS is not None else None
)


def write_later(connection: Connection) -> None:
    """Answers made outside a read (durable sends released by a flush, held pulls) leave
    in one callback for every connection with some, after the callback that made them,
    instead of a callback per connection: a flush releases one answer to each of many
    connections."""
    loop = connection.broker.loop
    if getattr(_per_loop, "loop", None) is not loop:  # a loop closed with answers unwritten
        _per_loop.loop, _per_loop.writers = loop, []
    waiting: list[Connection] = _per_loop.writers
    if not waiting:
        loop.call_soon(_write_waiting, waiting)
    waiting.append(connection)


def _write_waiting(waiting: list[Connection]) -> None:
    connections = waiting[:]
    waiting.clear()
    for connection in connections:
        try:
            connection._write_out()
        except Exception:  # one connection's failure must not keep the others' answers
            log.exception("%s: writing its answers failed", connection.where)


def release_durable(batch: list[Entry], error: BaseException | None) -> None:
    """The answers of one group commit's fdatasync (groupcommit.py), in the loop callback
    that got them, written in one ``transport.write`` per connection right here, not in a
    further callback.

    The commonest batch, plain sends' answers alone (each a Frame, made whole at append
    time by the C packer), is answered in C (cext/release.c): grouped by connection, each
    one's frames joined, its in_flight counted down and one write, no Python per
    connection (at one send in flight per connection the Python loop was the broker's
    largest share of Python per durable send, issue 23); a connection with more to do
    goes through _release_one. Any other batch, or a failed flush, goes answer by
    answer."""
    if release_frames is not None and error is None and batch:
        counters = batch[0][0].broker.counters  # type: ignore[attr-defined]
        try:
            if release_frames(batch, Frame, counters, _release_one, _write_failed):
                return
        except Exception:  # (no memory; "the batch changed"): nothing answered or counted yet
            log.exception("grouping %d durable answers by connection failed", len(batch))
    _release_each(batch, error)


def _release_one(connection: Connection, data: bytes, count: int) -> None:
    """release_frames' answers for a connection with more to do than a write: answers
    queued before these go first; closed or half-closed, _released decides."""
    connection.in_flight -= count
    transport = connection.transport
    if (
        connection._out  # answers queued before these go first
        or connection._ended  # to close after its last answer
        or connection._batching
        or connection.closed
        or transport is None
    ):
        connection._released(data)
    elif not transport.is_closing():
        connection.broker.counters.bytes_out += len(data)
        transport.write(data)


def _write_failed(connection: Connection, error: BaseException) -> None:
    log.error("%s: writing its answers failed", connection.where, exc_info=error)


def _release_each(batch: list[Entry], error: BaseException | None) -> None:
    """release_durable answer by answer: each connection's answers queued (finish), then
    written, one write per connection."""
    written: list[Connection] = []
    for peer, request_id, result in batch:
        connection: Connection = peer  # type: ignore[assignment]  # (no cast call per send)
        try:
            if not connection._batching:
                connection._batching = True  # queue, do not schedule a write
                written.append(connection)
            connection.finish(request_id, result if error is None else error)
        except Exception:  # one connection's failure must not keep the others' answers
            log.exception("%s: answering a durable send failed", connection.where)
    for connection in written:
        connection._batching = False
        try:
            connection._write_out()
        except Exception:
            log.exception("%s: writing its answers failed", connection.where)
