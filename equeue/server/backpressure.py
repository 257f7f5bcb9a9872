"""A connection's backpressure (the half of connection.py's Connection that pauses and
resumes it): past ``write_buffer_high`` bytes of answers the client has not read, reading
it pauses, and the frames of a read not yet served wait in ``_backlog`` until the
transport's ``resume_writing``; a held pull's answer waits for room (holds.py:
``has_room``, ``wait_for_room``). A stalled client holds its own socket buffers, not the
broker's memory.

Connection's base, not functions it calls: its methods are found on the class as
before (asyncio calls ``pause_writing`` and ``resume_writing`` on the protocol, holds.py
``has_room``), and a read's ``self._serve`` costs the same attribute look-up it did."""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import ProtocolError

if TYPE_CHECKING:
    import asyncio

    from equeue.errors import EQueueError
    from equeue.protocol.frames import FrameReader
    from equeue.server.serve import Broker


class Backpressure:
    # No slots of its own: Connection's layout (its slots, which the C paths read, and
    # its __dict__) is as it was. Not seen by mypy, which would hold these methods'
    # assignments to the empty tuple; Connection's slots and dict hold them.
    if not TYPE_CHECKING:
        __slots__ = ()

    if TYPE_CHECKING:  # Connection's, which these methods read and call
        broker: Broker
        transport: asyncio.Transport | None
        closed: bool
        in_flight: int
        _paused: bool
        _batching: bool
        _ended: bool
        _backlog: list[bytes]
        _out_bytes: int
        _write_high: int
        _reader: FrameReader

        def _request(self, body: bytes) -> None: ...
        def _write_out(self) -> None: ...
        def _fatal(self, exc: EQueueError) -> None: ...
        def close(self) -> None: ...

    def pause_writing(self) -> None:
        self._paused = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
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

    def has_room(self) -> bool:
        """Whether an answer made outside a read (a held pull's) may be queued now: the
        answers waiting to be written are within write_buffer_high (a closed connection
        takes any: finish drops it)."""
        transport = self.transport
        if self.closed or transport is None:
            return True
        waiting = transport.get_write_buffer_size() + self._out_bytes
        return not self._paused and waiting <= self._write_high

    def wait_for_room(self) -> None:
        """Held pulls wait for room (holds.py): resume_writing makes it when the transport
        paused; else the answers that took it are not written yet: after their write."""
        if not self._paused and not self.closed:
            self.broker.loop.call_soon(self._room_written)

    def _room_written(self) -> None:
        if not self._paused and not self.closed:
            self.broker.holds.room_made(self)

    def _serve(self, bodies: list[bytes]) -> None:
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

    @property
    def buffered(self) -> int:
        """Answer bytes not yet taken by the client's socket, and request bytes not yet served."""
        transport = self.transport
        written = transport.get_write_buffer_size() if transport is not None else 0
        return written + self._out_bytes + sum(map(len, self._backlog)) + self._reader.pending
