"""The broker's side of the shared-memory rings (``equeue serve --shm``;
docs/protocol.md "Shared-memory rings"; equeue/cext/shmring.c does the rings).

A unix: connection whose hello asks for rings gets its welcome by sendmsg with the
ring region's memfd, sealed (and, for the first connection of its (peer pid, group),
the client's end of the group's wake-up socketpair). From then on the Connection's
transport is an ShmTransport: its requests come from the ring through its group's
ShmMux (the loop reads the group's end of the socketpair and hands each ring's bytes to
its Connection's get_buffer/buffer_updated, the send lane included, as a socket read
does); its answers go into the answer ring, one wake-up byte per client group and loop
turn when the group's reader sleeps. The socket is kept for its end only: bytes on it
close the connection, its EOF half-closes it as on a socket.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING, Any

from equeue.errors import ProtocolError, ShmRingError
from equeue.protocol import shmrings

if TYPE_CHECKING:
    from equeue.server.connection import Connection

log = logging.getLogger("equeue.server")

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class _Group:
    """A client group's wake-up socket (a stream socketpair: this end read by the loop
    and sent a byte to wake the client; the other end is the client's) and the reader of
    its rings.

    Two ends, not eventfds: an eventfd sent to the client is one open file description
    for both, and O_NONBLOCK lives there: a client that cleared it blocked the broker's
    loop in a wake-up write, or in the drain's read once it had taken the count itself
    (reviewshm F11). Each end is its own description, and the broker passes
    MSG_DONTWAIT on every call. A reader a group, not one for the broker: a wake-up costs
    the rings of the group woken (F5: 34 µs a drain over 1,024 idle rings), and one
    group's trouble leaves the others' sleeping flags alone."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.end, self.client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.end.setblocking(False)
        self.waker = shmrings.ShmWaker(self.end.fileno(), loop.call_soon)
        self.mux = shmrings.ShmMux()
        self.mux.again = loop.call_soon  # (a drain cut short after its passes)
        self.mux.eof = self.client_gone
        self.rings = 0
        self.loop = loop
        self.watched = True
        loop.add_reader(self.end.fileno(), self.mux.drain, self.end.fileno())

    def client_gone(self) -> None:
        """The client closed its end of the wake-up socket: not watched any more (its
        end of file is readable for ever). Its rings are read when its connections end,
        or not at all: a client that closed its end while its connections stay open
        stalls only them."""
        if self.watched:
            self.watched = False
            self.loop.remove_reader(self.end.fileno())

    def sent(self) -> None:
        """The client has its end (sent with the group's first welcome): ours goes."""
        self.client_end.close()

    def wake(self) -> None:
        """The group's reader runs on a later loop turn, as if a client had woken it (one
        drain a turn, with its byte budget: cext/shmring.c mux_again)."""
        self.mux.schedule()

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        self.client_gone()
        self.waker.close()
        self.end.close()
        self.client_end.close()


class BrokerShm:
    """The rings of one broker loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring_bytes: int) -> None:
        self.loop = loop
        self.ring_bytes = shmrings.check_ring_bytes(ring_bytes)
        self.drains = 0  # (of the groups closed since: stats())
        self.groups: dict[tuple[int, str], _Group] = {}
        self.told_pid_zero = False  # (logged once a broker: a warning per connection floods)

    def attach(self, conn: Connection, welcome: bytes, group_name: str) -> bool:
        """The welcome sent with the rings and the connection moved onto them; False:
        nothing done (not a plain unix: socket), the caller sends the welcome as usual."""
        transport = conn.transport
        fd = conn._fd
        if transport is None or fd < 0 or conn._out:
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            return False
        pid = peer_pid(sock)
        if pid == 0:
            self._refuse_pid_zero(conn)
            return False
        key = (pid, group_name)
        group = self.groups.get(key)
        fresh = group is None
        total = shmrings.region_bytes(self.ring_bytes)
        memfd = -1
        try:  # (no descriptor left, no memory: the connection stays on its socket)
            if group is None:
                group = _Group(self.loop)
            memfd = os.memfd_create("equeue-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(memfd, total)
            # (a client's ftruncate SIGBUSed the broker, reviewshm F1: shmrings.SEALS)
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, shmrings.SEALS)
            ring = ShmTransport(memfd, total, shmrings.BROKER)
            # asleep until a client's write wakes the group: set before the client can
            # write (after the welcome), or its first write would see no sleeper
            ring.set_reader_sleeps(True)
            fds = [memfd, group.client_end.fileno()] if fresh else [memfd]
            with socket.socket(fileno=os.dup(fd)) as dup:
                sent = socket.send_fds(dup, [welcome], fds)
        except OSError:
            if fresh and group is not None:
                group.close(self.loop)
            log.exception("%s: setting up its shared rings failed", conn.where)
            return False
        finally:
            if memfd >= 0:
                os.close(memfd)
        if sent != len(welcome):  # (a fresh socket takes a welcome whole)
            ring.unmap()
            if fresh:
                group.close(self.loop)
            conn._fatal(ShmRingError(f"{conn.where}: the welcome was cut at {sent} bytes"))
            return True
        if fresh:
            self.groups[key] = group
            group.sent()
        group.rings += 1
        group.waker.at_once = group.rings == 1  # (cext/shmring.c waker_note)
        conn.broker.counters.bytes_out += sent
        ring.setup(self, key, group, conn, transport)
        ring.waker = group.waker
        conn.transport = ring
        conn._fd = -1  # answers go through ring.write (cext/release.c, sendlane.c)
        transport.set_protocol(_SocketEnd(conn, ring))
        group.mux.add(ring)
        return True

    def _refuse_pid_zero(self, conn: Connection) -> None:
        """A peer in a pid namespace this broker cannot see (SO_PEERCRED's pid is 0 for
        every one of them): a group keyed (0, name) is joinable by any such peer that
        learns the name, and rides on that group's wake-ups (reviewshm2 N6). Its
        connection stays on its socket instead: no group is ever joined by a process
        other than the one that made it."""
        if not self.told_pid_zero:
            self.told_pid_zero = True
            log.warning(
                "%s: shared rings refused, this connection stays on its socket: the peer "
                "is in a pid namespace the broker cannot see (SO_PEERCRED pid 0), and "
                "its ring group could not be told from another such peer's (logged once)",
                conn.where,
            )

    def detach(self, ring: ShmTransport) -> None:
        if not ring.attached:
            return
        ring.attached = False
        ring.group.mux.remove(ring)
        group = self.groups.get(ring.key)
        if group is ring.group:
            group.rings -= 1
            group.waker.at_once = group.rings == 1
            if group.rings <= 0:
                del self.groups[ring.key]
                self.drains += group.mux.drains
                group.close(self.loop)

    def stats(self) -> dict[str, int]:
        """stats()'s "shm" (docs/protocol.md): what the rings hold and how often their
        readers ran (a reader that runs with nothing to read is a spinning one)."""
        groups = list(self.groups.values())
        return {
            "connections": sum(g.rings for g in groups),
            "groups": len(groups),
            "ring_bytes": self.ring_bytes,
            "mapped_bytes": sum(g.rings for g in groups) * shmrings.region_bytes(self.ring_bytes),
            "drains": self.drains + sum(g.mux.drains for g in groups),
        }

    def close(self) -> None:
        for group in self.groups.values():
            group.close(self.loop)
        self.groups.clear()


def peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid as this broker's pid namespace sees it (0: it cannot)."""
    pid: int = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    return pid


class ShmTransport(shmrings.ShmRing if shmrings.ShmRing is not None else object):  # type: ignore[misc]
    """The Connection's transport once on rings (what connection.py and release.py call)."""

    def setup(
        self,
        shm: BrokerShm,
        key: tuple[int, str],
        group: _Group,
        conn: Connection,
        socket_end: Any,
    ) -> None:
        self.shm = shm
        self.key = key
        self.group = group
        self.protocol = conn
        self.socket_end = socket_end
        self.rest = bytearray()  # answers the ring had no room for yet, in order
        self.high = conn.broker.config.write_buffer_high  # (as the socket's transport had)
        self.closing = False
        self.attached = True  # (in its group's reader, counted in the group)
        self.writing_paused = False
        # The client half-closed (end_seen); the Connection was told, after every request
        # before the end was read (end_taken): take_end
        self.end_seen = False
        self.end_taken = False

    # --- the answers ---------------------------------------------------------

    def _queue_rest(self, data: bytes, sent: int) -> None:
        """cext/shmring.c's write: what did not fit waits here (then ShmMux's on_room)."""
        if self.closing:
            return
        self.rest += memoryview(data)[sent:]
        self.queued = 1
        if len(self.rest) > self.high and not self.writing_paused:
            self.writing_paused = True
            self.protocol.pause_writing()

    def on_room(self) -> None:
        taken = self.put(self.rest)
        del self.rest[:taken]
        if not self.rest:
            self.queued = 0
            if self.closing:  # (close() waited for these answers)
                self._closed()
                return
        if self.writing_paused and len(self.rest) <= self.high // 4:
            self.writing_paused = False
            self.protocol.resume_writing()

    def _write_broke(self, error: ShmRingError) -> None:
        """cext/shmring.c: an answer's write found the answer ring's tail (the client's)
        out of bounds. The connection closes on the next loop turn, not under its writer
        (release.py writes many connections' answers in one pass); this ring's writes are
        dropped meanwhile."""
        self.rest.clear()
        self.queued = 0
        self.shm.loop.call_soon(self.on_broken, error)

    def on_broken(self, error: BaseException) -> None:
        """A ring index out of bounds, or the Connection's read raised: this one closes."""
        conn = self.protocol
        if conn is None or conn.closed:
            self.abort()
            return
        if isinstance(error, ShmRingError):  # (from C: it does not know the connection)
            conn._fatal(ShmRingError(f"{conn.where}: {error}"))
        elif isinstance(error, ProtocolError):
            conn._fatal(error)
        else:
            log.error("%s: reading its ring failed", conn.where, exc_info=error)
            self.abort()

    def get_write_buffer_size(self) -> int:
        return len(self.rest)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self.high = high

    # --- the rest of asyncio.Transport the Connection calls --------------------

    def pause_reading(self) -> None:
        self.paused = 1

    def resume_reading(self) -> None:
        if self.paused and not self.closing and not self.end_taken:
            self.paused = 0
            if self.end_seen:  # (on the next turn: not inside the Connection's own call)
                self.shm.loop.call_soon(self.take_end)
            else:
                self.group.wake()

    def take_end(self) -> None:
        """The client's half-close, passed to the Connection as a socket passes its EOF:
        after every request the client put in the ring before it. This ring's bytes are
        read now, with no budget (reviewshm F6: they were dropped unread), and no other
        ring of the group (review9 R9-2). A connection whose reading is paused (its
        answers back up), before or during that read, gets its end once it resumes
        reading (resume_reading calls this again): review10 F2, the half-close read
        nothing at a paused ring and the requests left in it went unanswered."""
        if self.closing or self.paused or self.end_taken:
            return
        self.group.mux.drain_ring(self)
        if self.closing or self.paused:  # (the read paused it, or broke it)
            return
        self.end_taken = True
        self.paused = 1  # (nothing after the end is a request)
        if self.protocol.eof_received() is None:
            self.close()

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.socket_end.get_extra_info(name, default)

    def close(self) -> None:
        """As asyncio's close: the answers still waiting for room in the ring are written
        first (reviewshm F8: a SIGTERM's drain or a half-closed client lost them); no
        request is read after it."""
        if self.closing:
            return
        self.closing = True
        self.paused = 1
        if not self.rest:
            self._closed()
        # else: on_room closes it once the client's reads made room for the rest (or
        # abort, at the drain's deadline, or the socket's end)

    def _closed(self) -> None:
        self.shm.detach(self)
        self.socket_end.close()  # its protocol (_SocketEnd) passes connection_lost on

    def abort(self) -> None:
        self.closing = True
        self.rest.clear()
        self.queued = 0
        self.shm.detach(self)
        self.socket_end.abort()


class _SocketEnd(asyncio.Protocol):
    """The socket of a connection on rings: its end (or any byte on it) ends it."""

    def __init__(self, conn: Connection, ring: ShmTransport) -> None:
        self.conn = conn
        self.ring = ring

    def data_received(self, data: bytes) -> None:
        self.conn._fatal(
            ProtocolError(
                f"{self.conn.where}: {len(data)} bytes on the socket of a connection on "
                "shared rings (its requests go in the ring)"
            )
        )

    def eof_received(self) -> bool:
        """The client half-closed: the Connection takes it as on a socket once the
        requests before it are read (ShmTransport.take_end); the ring closes once the
        last answer is in it, and the socket with it."""
        ring = self.ring
        if not ring.closing:  # (closing already: _closed ends the socket)
            ring.end_seen = True
            ring.take_end()
        return True  # (the socket stays until the ring's close ends it)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ring.closing = True
        self.ring.rest.clear()
        self.ring.shm.detach(self.ring)
        self.conn.connection_lost(exc)
        self.ring.protocol = None  # type: ignore[assignment]  # (the ring outlives it)
