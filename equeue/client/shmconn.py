"""The asyncio client's side of the shared-memory rings
(``equeue.aio.connect("unix:PATH", shm=True)`` against ``equeue serve --shm``;
equeue/protocol/shmrings.py says what travels, equeue/cext/shmring.c how).

The connection is made and its hello sent on a socket of its own; the welcome is read
with recvmsg, and the descriptors beside it (the ring region; for a group's first
connection the client's end of the group's wake-up socketpair) make an
ShmClientTransport. Every connection of one event loop to one broker socket is in one
group: one ShmMux, read by the loop when a wake-up byte arrives, hands each ring's
answers to its protocol (ClientConn's reads, in C); requests are written into the ring by
ClientConn (in C) and the broker woken by one byte sent a loop turn when it sleeps. A
broker without --shm answers a plain welcome: the connection then goes on over its
socket, as without shm.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import socket
import weakref
from asyncio.trsock import TransportSocket
from collections.abc import Callable
from typing import Any

from equeue.client import forks
from equeue.client.url import Endpoint
from equeue.errors import ShmRingError
from equeue.protocol import shmrings
from equeue.protocol.frames import FRAME_HEADER, FRAME_HEADER_SIZE, HELLO_MAX_FRAME_BYTES


class _Group:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.name = secrets.token_hex(8)
        self.mux = shmrings.ShmMux()
        self.mux.again = loop.call_soon  # (a drain cut short after its passes)
        self.wake_fd = -1  # our end of the group's wake-up socketpair (the broker's)
        self.opening = 0  # (connections between their hello and their transport)
        self.watched = False  # (wake_fd in the loop's readers)
        self.waker: Any = None
        self.rings: weakref.WeakSet[ShmClientTransport] = weakref.WeakSet()
        # wake_fd closed when the group is collected unclosed (its loop closed, its
        # clients dropped without close(): review9 R9-5)
        self.closer: weakref.finalize[[int], _Group] | None = None

    def take(self, wake_fd: int) -> None:
        """A group's wake-up socket from the broker (again after it restarted: the old
        one goes). A byte sent wakes the broker's reader; one received, ours."""
        self.drop_fds()
        self.wake_fd = wake_fd
        self.closer = weakref.finalize(self, os.close, wake_fd)
        self.waker = shmrings.ShmWaker(wake_fd, self.loop.call_soon)
        self.count_rings()
        self.mux.eof = self.broker_gone
        self.watched = True
        self.loop.add_reader(wake_fd, self.mux.drain, wake_fd)

    def broker_gone(self) -> None:
        """The broker closed its end (the group's last connection ended, or the broker
        did): not watched any more, its end of file being readable for ever. The next
        connection's welcome brings the group a new socket."""
        if self.watched:
            self.watched = False
            self.loop.remove_reader(self.wake_fd)

    def count_rings(self) -> None:
        """One ring: its wake-ups are sent at once (cext/shmring.c waker_note)."""
        if self.waker is not None:
            self.waker.at_once = len(self.rings) == 1

    def drop_fds(self) -> None:
        if self.wake_fd >= 0:
            self.broker_gone()
            self.waker.close()
            if self.closer is not None:
                self.closer.detach()
            os.close(self.wake_fd)
            self.wake_fd = -1

    def forget_if_unused(self) -> None:
        """Its last connection gone (and none on its way): the group goes with its
        descriptor, as the broker's does, and the next connection makes a group of its
        own. Kept, it held its loop (reviewshm2 N7: _groups' weak keys never died, a
        descriptor and a loop kept per asyncio.run() that used shm)."""
        if self.rings or self.opening:
            return
        self.drop_fds()
        by_path = _groups.get(self.loop)
        if by_path is not None:
            for path, group in list(by_path.items()):
                if group() in (self, None):
                    del by_path[path]
            if not by_path:
                del _groups[self.loop]


def _forked() -> None:
    """In a forked child: the mappings and the wake-up sockets are the parent's. Every
    ring is unmapped first (this process only: each ring operation is then a no-op; an
    munmap needs no descriptor), then each socket's number points at a socket whose
    peer is gone, so that a child running the inherited loop neither takes the parent's
    answers out of the answer ring nor reads its wake-ups (the epoll set, shared, still
    reports them). A child whose descriptor table is full cannot make that socket: its
    numbers stay the parent's sockets (a wake-up byte the child may read, no answer),
    and the other groups are done all the same (reviewshm2 N8: one OSError left them
    mapped)."""
    groups = [g for by_path in list(_groups.values()) for ref in by_path.values() if (g := ref())]
    _groups.clear()  # (a new connection in the child makes a group of its own)
    for group in groups:
        for ring in list(group.rings):
            ring.unmap()
    for group in groups:
        if group.wake_fd >= 0:
            if group.waker is not None:
                group.waker.close()  # (no wake-up sent from the child)
            with contextlib.suppress(OSError):
                forks.point_at_a_dead_socket(group.wake_fd)


# Each loop's groups by broker path. Weak both ways: a group is held by what uses it (its
# transports, the loop's reader of its wake-up socket, a connection being opened), never
# by this table, else a group's loop (its key) stayed alive through it, and with it every
# transport a job dropped without close() (review9 R9-5: 21 asyncio.run() jobs that did
# not close their client kept 21 loops, 42 sockets and 21 broker connections for good; a
# socket connection is closed by the collector). A closed loop no longer reads its
# groups: dropped, it is collected with them, their sockets and their wake-up ends.
_groups: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, weakref.ref[_Group]]] = (
    weakref.WeakKeyDictionary()
)


os.register_at_fork(after_in_child=_forked)


def group_of(loop: asyncio.AbstractEventLoop, path: str) -> _Group:
    by_path = _groups.setdefault(loop, {})
    ref = by_path.get(path)
    group = ref() if ref is not None else None
    if group is None:
        group = _Group(loop)
        by_path[path] = weakref.ref(group)
    return group


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _welcome(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, where: str
) -> tuple[bytes, list[int]]:
    """The welcome frame's bytes and the descriptors that came with them."""
    data = b""
    fds: list[int] = []
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _settle, ready)
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())
        try:
            more, got = shmrings.recv_with_fds(sock, HELLO_MAX_FRAME_BYTES)
        except BlockingIOError:
            continue
        fds += got
        if not more:
            for fd in fds:
                os.close(fd)
            raise ConnectionResetError(f"{where}: the broker closed the connection at its hello")
        data += more
        if len(data) >= FRAME_HEADER_SIZE:
            (length,) = FRAME_HEADER.unpack_from(data, 0)
            if len(data) >= FRAME_HEADER_SIZE + length:
                return data, fds


async def open_connection(
    loop: asyncio.AbstractEventLoop,
    endpoint: Endpoint,
    protocol: Any,
    hello: Callable[[str], bytes],
) -> None:
    """Connect, hello (asking for rings), welcome; the protocol is then made and fed the
    welcome over rings, or over its socket where the broker sent none."""
    group = group_of(loop, endpoint.path)
    group.opening += 1
    try:
        await _open(loop, endpoint, protocol, hello, group)
    finally:
        group.opening -= 1
        group.forget_if_unused()


async def _open(
    loop: asyncio.AbstractEventLoop,
    endpoint: Endpoint,
    protocol: Any,
    hello: Callable[[str], bytes],
    group: _Group,
) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, endpoint.path)
        await loop.sock_sendall(sock, hello(group.name))
        data, fds = await _welcome(loop, sock, str(endpoint))
    except BaseException:
        sock.close()
        raise
    if not fds:  # a broker without --shm: the socket's own transport
        await loop.create_unix_connection(lambda: protocol, sock=sock)
        protocol.data_received(data)
        return
    try:
        if len(fds) == 2:
            group.take(fds[1])
        elif len(fds) != 1 or group.wake_fd < 0:
            raise ShmRingError(
                f"{endpoint}: the broker's welcome came with {len(fds)} descriptors "
                f"(1, or 2 for a ring group's first connection)"
            )
        # A region that could shrink under the mapping would fault this process (SIGBUS)
        # at its next read of the ring: only a sealed one is mapped (reviewshm F1)
        seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        if seals & shmrings.SEALS != shmrings.SEALS:
            raise ShmRingError(
                f"{endpoint}: the broker's ring region is not sealed against resizing "
                f"(seals {seals:#x}, F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL wanted)"
            )
        size = os.fstat(fds[0]).st_size
        transport = ShmClientTransport(fds[0], size, shmrings.CLIENT)
    except BaseException:
        for fd in fds[: 1 if len(fds) == 2 else None]:
            os.close(fd)
        sock.close()
        raise
    os.close(fds[0])  # (the mapping stays)
    transport.setup(loop, group, sock, protocol)
    protocol.connection_made(transport)
    protocol.data_received(data)


class ShmClientTransport(shmrings.ShmRing if shmrings.ShmRing is not None else object):  # type: ignore[misc]
    """asyncio.Transport's methods the client calls (rawconn.py lists them), on rings."""

    def setup(
        self, loop: asyncio.AbstractEventLoop, group: _Group, sock: socket.socket, protocol: Any
    ) -> None:
        self.loop = loop
        self.group = group
        self.sock = sock
        self.protocol = protocol
        self.waker = group.waker
        self.rest = bytearray()
        self.closing = False
        self.extra = {"socket": TransportSocket(sock), "peername": endpoint_name(sock)}
        self.set_reader_sleeps(True)  # asleep until the broker's answer wakes the group
        group.mux.add(self)
        group.rings.add(self)
        group.count_rings()
        loop.add_reader(sock.fileno(), self._socket_ready)

    def _queue_rest(self, data: bytes, sent: int) -> None:
        if not self.closing:
            self.rest += memoryview(data)[sent:]
            self.queued = 1

    def on_room(self) -> None:
        taken = self.put(self.rest)
        del self.rest[:taken]
        if not self.rest:
            self.queued = 0

    def _write_broke(self, error: ShmRingError) -> None:
        """cext/shmring.c: a request's write found the request ring's tail (the
        broker's) out of bounds: the connection fails on the next loop turn, not under
        the caller of write; its writes are dropped meanwhile."""
        self.rest.clear()
        self.queued = 0
        self.loop.call_soon(self.on_broken, error)

    def on_broken(self, error: BaseException) -> None:
        protocol = self.protocol
        if protocol is not None:
            protocol.fail(f"the broker at {protocol.where} broke its shared rings: {error}", error)
        self.abort()

    def _socket_ready(self) -> None:
        """The socket carries only its end: the answers in the ring are read first."""
        try:
            data = self.sock.recv(1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not self.closing:  # (this ring's answers, all of them: the group's others wait)
            self.group.mux.drain_ring(self)
        self._lost(None if not data else ShmRingError("the broker wrote on a shared-ring socket"))

    def _lost(self, exc: Exception | None) -> None:
        protocol, self.protocol = self.protocol, None
        self.abort()
        if protocol is not None:
            protocol.connection_lost(exc)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def is_closing(self) -> bool:
        return self.closing

    def get_protocol(self) -> Any:
        return self.protocol

    def get_write_buffer_size(self) -> int:
        return len(self.rest)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # (the client bounds its requests in flight; its rest waits for room)

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.group.mux.remove(self)
        self.group.rings.discard(self)
        self.group.count_rings()
        self.group.forget_if_unused()
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        protocol, self.protocol = self.protocol, None
        if protocol is not None:
            self.loop.call_soon(protocol.connection_lost, None)


def endpoint_name(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None
