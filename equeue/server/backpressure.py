"""A connection's backpressure (connection.py's Connection: the methods that pause and
resume it): past ``write_buffer_high`` bytes of answers the client has not read, reading
it pauses, and the frames of a read not yet served wait in ``_backlog`` until the
transport's ``resume_writing``; a held pull's answer waits for room (holds.py:
``has_room``, ``wait_for_room``). A stalled client holds its own socket buffers, not the
broker's memory.

Functions bound into Connection's class body (as client/syncmethods.py's into Client):
the same function objects are the connection's methods, looked up as before (asyncio
calls ``pause_writing`` and ``resume_writing`` on the protocol, a read ``self._serve``);
no call and no base class added."""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import ProtocolError

if TYPE_CHECKING:
    from equeue.server.connection import Connection


def pause_writing(self: Connection) -> None:
    self._paused = True
    if self.transport is not None and not self.closed:
        self.transport.pause_reading()


def resume_writing(self: Connection) -> None:
    self._paused = False
    if self.closed:
        return
    holds = self.broker.holds
    if self._backlog or holds.starving(self):
        self._batching = True
        try:
            holds.room_made(self)  # the held pulls first: read before the backlog
            if self._backlog:
                self._serve(self._backlog)
        except ProtocolError as exc:
            self._fatal(exc)
        finally:
            self._batching = False
            self._write_out()
            self.broker.after_batch()
    if self._ended and not self.in_flight and not self._backlog:
        self.close()
    elif not self._paused and not self._backlog and not self.broker.draining:
        assert self.transport is not None
        self.transport.resume_reading()


def has_room(self: Connection) -> bool:
    """Whether an answer made outside a read (a held pull's) may be queued now: the
    answers waiting to be written are within write_buffer_high (a closed connection
    takes any: finish drops it)."""
    transport = self.transport
    if self.closed or transport is None:
        return True
    waiting = transport.get_write_buffer_size() + self._out_bytes
    return not self._paused and waiting <= self._write_high


def wait_for_room(self: Connection) -> None:
    """Held pulls wait for room (holds.py): resume_writing makes it when the transport
    paused; else the answers that took it are not written yet: after their write."""
    if not self._paused and not self.closed:
        self.broker.loop.call_soon(self._room_written)


def _room_written(self: Connection) -> None:
    if not self._paused and not self.closed:
        self.broker.holds.room_made(self)


def _serve(self: Connection, bodies: list[bytes]) -> None:
    """Answer ``bodies`` in order until the client's unread answers pass the high-water
    mark; the rest wait in the backlog for ``resume_writing``. So one read of many
    small requests with large answers (pulls) cannot make the broker hold more than
    about ``write_buffer_high`` plus one answer for a client that does not read."""
    high = self.broker.config.write_buffer_high
    transport = self.transport
    assert transport is not None
    done = 0
    request = self._request
    # The transport's buffer changes only by _write_out here: read it after each.
    room = high - transport.get_write_buffer_size()
    for body in bodies:
        done += 1
        request(body)
        if self.closed:
            break
        if self._out_bytes > room:
            self._write_out()  # may call pause_writing
            if self._paused:
                break
            room = high - transport.get_write_buffer_size()
    self._backlog = bodies[done:] if done < len(bodies) and not self.closed else []
    if self._backlog:
        transport.pause_reading()


def buffered(self: Connection) -> int:
    """Answer bytes not yet taken by the client's socket, and request bytes not yet served."""
    transport = self.transport
    written = transport.get_write_buffer_size() if transport is not None else 0
    return written + self._out_bytes + sum(map(len, self._backlog)) + self._reader.pending
