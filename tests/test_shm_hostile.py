"""A hostile client of the shared rings (equeue/cext/shmring.c, equeue/server/shm.py)
against a real broker: whatever it does to the memory it shares with the broker, its own
connection closes and every other connection is served."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker
from server_helpers import raw
from shm_helpers import ANSWERS_READER_SLEEPS, ANSWERS_TAIL, RawShm
from test_broker_limits import _serve
from test_broker_limits import _url as _limits_url
from test_shm import _broker, _url

import equeue
import equeue.aio
from equeue.errors import ShmRingError
from equeue.protocol import shmrings
from equeue.protocol.frames import SUPPORTED_VERSIONS, encode
from equeue.protocol.handshake import Welcome
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")

SEND = encode([1, "send", {"topic": "t", "body": b"hostile"}])


@pytest.fixture(name="broker")
def _default_broker() -> Iterator[BrokerThread]:
    yield from _broker()


@pytest.fixture(name="process")
def _broker_process() -> Iterator[BrokerProcess]:
    with temporary_broker("--shm", "--flush", "sync") as running:
        with equeue.connect(running.url) as admin:
            admin.create_topic("t", queue_count=1)
        yield running


def test_a_truncated_region_cannot_stop_the_broker(process: BrokerProcess) -> None:
    """The client shrinks the memfd under the broker's mapping (its next read of the
    ring: SIGBUS, the broker gone) and grows it: the region is sealed, both refused."""
    peer = RawShm(process.url[5:])
    refused = []
    try:
        assert peer.write(SEND) == len(SEND)  # (the client's own mapping: not touched after)
        for size in (peer.size * 2, shmrings.HEADER_BYTES, 0):
            try:
                os.ftruncate(peer.memfd, size)
            except PermissionError:
                refused.append(size)
        size = os.fstat(peer.memfd).st_size
        peer.wake()
        time.sleep(0.5)  # (the broker reads the ring: no assertion on time, only a chance)
    finally:
        with contextlib.suppress(OSError):
            peer.close()
    assert process.process is not None and process.process.poll() is None, "the broker died"
    assert refused == [peer.size * 2, shmrings.HEADER_BYTES, 0]
    assert size == peer.size

    async def after() -> None:
        client = await equeue.aio.connect(process.url, shm=True, timeout=10)
        try:
            await client.send("t", b"after")
        finally:
            await client.close()

    asyncio.run(after())
    with equeue.connect(process.url) as check:
        assert [m.body for m in check.pull("t", 0, 0, 10).messages][-1] == b"after"


def _hostile_answer_tail(broker: BrokerThread, tail: int) -> Any:
    """A raw connection whose answer ring's tail (the client's index) is set to ``tail``
    before it sends one request: what its socket saw, and the other client's offsets."""

    async def run() -> tuple[bool, list[int]]:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            assert (await client.send("t", b"before")).queue_offset == 0
            peer = RawShm(_url(broker)[5:])
            try:
                peer.ring.raw(ANSWERS_TAIL, tail.to_bytes(8, "little"))
                assert peer.write(SEND) == len(SEND)
                peer.wake()
                ended = await asyncio.to_thread(peer.socket_ended)
            finally:
                peer.close()
            after = [(await client.send("t", b"after %d" % i)).queue_offset for i in range(3)]
            return ended, after
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("tail", [1 << 40, (1 << 64) - (1 << 20)], ids=["ahead", "behind"])
def test_an_answer_ring_tail_out_of_bounds_closes_that_connection_only(
    broker: BrokerThread, tail: int
) -> None:
    """The broker's answer (after the request's fdatasync, in the release of every
    connection's answers) finds the tail out of bounds: that connection closes, the
    others' answers go on."""
    ended, after = _hostile_answer_tail(broker, tail)
    assert ended
    assert after == [2, 3, 4]  # (1: the hostile send, stored before its answer broke)
    deadline = time.monotonic() + 20
    while len(broker.broker.connections) > 0:
        assert time.monotonic() < deadline, "the hostile connection stayed"
        time.sleep(0.01)
    assert broker.broker.shm is not None and not broker.broker.shm.groups


@pytest.fixture(name="small")
def _small_broker() -> Iterator[BrokerThread]:
    yield from _broker(shm_ring_bytes=4096)


def test_a_tail_broken_while_answers_wait_for_room_closes_that_connection_only(
    small: BrokerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer larger than the ring waits in the broker for room; the client then
    sets the tail out of bounds and wakes the broker, whose reader finds room to look for
    (on_room) in the middle of serving every ring: that connection closes, and the
    reader goes on to the others."""
    small.store.send_batch("t", [bytes([i]) * 1000 for i in range(10)])

    async def run() -> tuple[bool, list[int]]:
        client = await equeue.aio.connect(_url(small), shm=True, timeout=10)
        try:
            peer = RawShm(_url(small)[5:])
            try:
                pull = encode([1, "pull", {"topic": "t", "queue_id": 0, "offset": 0}])
                assert peer.write(pull) == len(pull)
                peer.wake()
                deadline = time.monotonic() + 20
                while not _answers_waiting(small):  # (10 KB of answer, a 4 KiB ring)
                    await asyncio.sleep(0.01)
                    assert time.monotonic() < deadline, "no answer waited for room"
                peer.ring.raw(ANSWERS_TAIL, (1 << 40).to_bytes(8, "little"))
                peer.wake()
                ended = await asyncio.to_thread(peer.socket_ended)
            finally:
                peer.close()
            after = [(await client.send("t", b"after")).queue_offset for _ in range(2)]
            return ended, after
        finally:
            await client.close()

    ended, after = asyncio.run(run())
    assert ended
    assert after == [10, 11]
    # the client's doing, not a broker fault (reviewshm2 N1: "reading its ring failed",
    # a BufferError's traceback)
    assert not [r for r in caplog.records if r.exc_info or "reading its ring" in r.message]


def _answers_waiting(thread: BrokerThread) -> bool:
    """Whether a connection on rings holds answers the ring had no room for."""
    return any(getattr(c.transport, "queued", 0) for c in list(thread.broker.connections))


def test_both_indices_out_of_bounds_leave_the_other_clients_served(broker: BrokerThread) -> None:
    """The request ring's head and the answer ring's tail both out of bounds, one wake:
    the broker's reader refuses the head, its error answer's write finds the tail; the
    client of another group, asleep meanwhile, is still woken for (reviewshm F2: every
    one of them waited its timeout)."""

    async def run() -> list[int]:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            await client.send("t", b"before")
            peer = RawShm(_url(broker)[5:])
            try:
                peer.ring.raw(ANSWERS_TAIL, (1 << 41).to_bytes(8, "little"))
                head = (2 * peer.ring_bytes + 1).to_bytes(8, "little")
                peer.ring.raw(shmrings.REQUESTS_HEAD, head)
                peer.wake()
                assert await asyncio.to_thread(peer.socket_ended)
            finally:
                peer.close()
            return [(await client.send("t", b"after")).queue_offset for _ in range(2)]
        finally:
            await client.close()

    assert asyncio.run(run()) == [1, 2]


def test_the_connections_a_shm_broker_holds_are_sized_at_two_descriptors_each(
    tmp_path: Path,
) -> None:
    """A connection on rings may hold its socket and its own group's end of a wake-up
    socketpair (the group's name is the client's choice): under RLIMIT_NOFILE=512 the
    default max_connections is lowered to what fits at two each, not at one (reviewshm
    F7)."""
    broker = _serve(tmp_path / "s", 512, 512, "--shm")
    try:
        with raw(_limits_url(broker)) as client:
            # (512 - 256 store files - 1 listener - 64 of the broker's own) // 2
            assert client.welcome["limits"]["max_connections"] == 95
    finally:
        broker.terminate()
        broker.communicate(timeout=60)


@pytest.mark.parametrize(
    ("sealed", "size", "refusal"),
    [
        pytest.param(False, shmrings.region_bytes(4096), "not sealed", id="unsealed"),
        pytest.param(True, 5000, "region of 5000 bytes", id="bad-size"),
    ],
)
def test_a_client_refuses_a_region_it_cannot_use(
    tmp_path: Path, sealed: bool, size: int, refusal: str
) -> None:
    """A broker (here a fake one) that sends a region it could still shrink (the client
    would fault, SIGBUS, at its next read after an ftruncate: reviewshm F1, client side)
    or one of no ring size (F9: ValueError reached the caller): ShmRingError, before
    anything is mapped."""
    path = str(tmp_path / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(20)
    memfd = os.memfd_create("region", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
    os.ftruncate(memfd, size)
    if sealed:
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, shmrings.SEALS)
    wake, wake_peer = socket.socketpair()
    welcome = Welcome(SUPPORTED_VERSIONS[-1], "fake", _LIMITS).pack()

    def fake_broker() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(20)
            conn.recv(1 << 16)  # the hello
            socket.send_fds(conn, [encode(welcome)], [memfd, wake_peer.fileno()])
            conn.recv(1)  # until the client goes

    server = threading.Thread(target=fake_broker)
    server.start()
    try:

        async def connect() -> None:
            await equeue.aio.connect(f"unix:{path}", shm=True, connect_timeout=10)

        with pytest.raises(ShmRingError, match=refusal):
            asyncio.run(connect())
    finally:
        server.join(30)
        listener.close()
        os.close(memfd)
        wake.close()
        wake_peer.close()
    assert not server.is_alive()


_LIMITS = {"max_frame_bytes": 1 << 20, "max_in_flight": 64, "max_connections": 8}


def test_bytes_after_a_hello_asking_for_rings_are_refused_before_any_ring_is_made(
    broker: BrokerThread,
) -> None:
    """The refusal comes on the socket, with no descriptor, and no group is made
    (reviewshm F9: the rings were sent first and the refusal went into them)."""
    hello = {"versions": list(SUPPORTED_VERSIONS), "token": None, "shm": "g"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(_url(broker)[5:])
        sock.sendall(encode(hello) + encode([1, "topics", {}]))
        data, fds = shmrings.recv_with_fds(sock, 1 << 16)
        for fd in fds:
            os.close(fd)
        assert fds == []
        assert b"after a hello that asked for shared rings" in data
    assert broker.broker.shm is not None and not broker.broker.shm.groups


def test_a_wake_up_that_cannot_be_scheduled_does_not_fail_a_write_that_happened() -> None:
    """The loop's call_soon raising (a closed loop, at shutdown) after the bytes were
    published: put reports them written, the error goes to the unraisable hook (F9)."""
    total = shmrings.region_bytes(4096)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
    broker = shmrings.ShmRing(fd, total, shmrings.BROKER)
    os.close(fd)

    def closed_loop(fire: Any) -> None:
        raise RuntimeError("Event loop is closed")

    client.waker = shmrings.ShmWaker(-1, closed_loop)
    broker.set_reader_sleeps(True)
    seen: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        assert client.put(b"request") == 7
    finally:
        sys.unraisablehook = hook
    assert [type(u.exc_value) for u in seen] == [RuntimeError]
    got = bytearray(16)
    assert broker.read_into(got) == 7 and bytes(got[:7]) == b"request"


def test_set_reader_sleeps_raises_what_the_flags_truth_raised() -> None:
    """A flag whose truth raises: its error (shmring.c's set_reader_sleeps returned None
    with the error still set: CPython's call check raised SystemError in its place)."""
    total = shmrings.region_bytes(4096)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    ring = shmrings.ShmRing(fd, total, shmrings.CLIENT)
    os.close(fd)

    class Unsure:
        def __bool__(self) -> bool:
            raise ZeroDivisionError("no truth here")

    with pytest.raises(ZeroDivisionError, match="no truth here"):
        ring.set_reader_sleeps(Unsure())
    ring.set_reader_sleeps(True)


def test_the_test_hook_raw_refuses_an_offset_whose_end_overflows() -> None:
    total = shmrings.region_bytes(4096)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    ring = shmrings.ShmRing(fd, total, shmrings.CLIENT)
    os.close(fd)
    with pytest.raises(ValueError, match="outside the shared region"):
        ring.raw(sys.maxsize - 1, b"abc")


def test_a_client_that_makes_its_wake_up_end_blocking_cannot_block_the_broker(
    process: BrokerProcess,
) -> None:
    """The client's wake-up descriptor made blocking (and, were it an eventfd shared
    with the broker, its counter filled to the maximum), its answer ring asleep, one
    request: the broker's wake-up of it must not block its loop (reviewshm F11: with
    shared eventfds the broker's write blocked until the client read; every client, the
    socket ones too, timed out and SIGTERM could not stop it)."""
    peer = RawShm(process.url[5:])
    try:
        os.set_blocking(peer.client_wake_fd, True)
        if peer.client_wake_fd != peer.wake_fd:  # (an eventfd, as round 15 sent)
            os.eventfd_write(peer.client_wake_fd, (1 << 64) - 2)
        peer.ring.raw(ANSWERS_READER_SLEEPS, (1).to_bytes(4, "little"))
        assert peer.write(SEND) == len(SEND)
        peer.wake()
        time.sleep(0.5)  # (the broker answers and wakes the client: a chance, no timing)
        with equeue.connect(process.url, timeout=5, connect_timeout=5) as victim:
            assert victim.send("t", b"victim").topic == "t"
    finally:
        peer.close()
    assert process.process is not None
    process.process.terminate()
    assert process.process.wait(20) == 0


def test_a_client_that_closes_its_wake_up_end_does_not_keep_the_broker_busy(
    broker: BrokerThread,
) -> None:
    """Its end closed, the broker's end reads end-of-file for ever: watched still, the
    loop would call the group's reader every turn (thousands of drains a second, the
    broker's loop never idle); it stops watching it at the first."""
    peer = RawShm(_url(broker)[5:])
    try:
        shm = broker.broker.shm
        assert shm is not None
        deadline = time.monotonic() + 20
        while not shm.groups:  # (stored just after the welcome was sent)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (group,) = shm.groups.values()
        os.close(peer.wake_fd)
        peer.fds.remove(peer.wake_fd)
        while group.mux.drains == 0:  # (the end of file seen)
            assert time.monotonic() < deadline, "the end of file was never read"
            time.sleep(0.01)
        before = group.mux.drains
        time.sleep(0.3)  # (idle: nothing is sent; a spinning loop drains meanwhile)
        assert group.mux.drains == before
    finally:
        peer.close()


def test_a_client_group_whose_broker_end_closed_is_not_read_again(broker: BrokerThread) -> None:
    """The group's last connection closed, the broker closes its end of the wake-up
    socket: the client's loop stops watching its end (else every later turn of an idle
    client's loop drains), and a new connection gets the group a new socket."""

    async def run() -> tuple[int, int, int]:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        group = client._protocol.transport.group  # type: ignore[union-attr]
        await client.send("t", b"one")
        await client.close()
        deadline = time.monotonic() + 20
        while broker.broker.shm.groups:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the broker kept the group"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # (the end of file reaches this loop)
        before = group.mux.drains
        await asyncio.sleep(0.3)  # (idle)
        after = group.mux.drains
        again = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            offset = (await again.send("t", b"two")).queue_offset
        finally:
            await again.close()
        return before, after, offset

    before, after, offset = asyncio.run(run())
    assert after == before
    assert offset == 1


class _Soon:
    """A loop's call_soon that records what it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def call_soon(self, *call: Any) -> None:
        self.calls.append(call)


@pytest.mark.parametrize("side", ["broker", "client"])
def test_a_tail_broken_while_bytes_wait_for_room_is_a_shm_ring_error_on_both_sides(
    side: str,
) -> None:
    """on_room puts the transport's rest (a bytearray) and the peer's tail is out of
    bounds: _write_broke drops that rest and schedules on_broken with the ShmRingError.
    The put held a view of the rest meanwhile: its drop raised a builtin BufferError,
    which the broker logged as its own read failure (reviewshm2 N1)."""
    from equeue.client.shmconn import ShmClientTransport
    from equeue.server.shm import ShmTransport

    total = shmrings.region_bytes(4096)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    soon = _Soon()
    transport: Any
    if side == "broker":
        transport = ShmTransport(fd, total, shmrings.BROKER)
        transport.shm = type("Shm", (), {"loop": soon})()
        transport.closing = transport.writing_paused = False
        transport.high = 1 << 20
        tail = ANSWERS_TAIL  # (the client's index of the answer ring)
    else:
        transport = ShmClientTransport(fd, total, shmrings.CLIENT)
        transport.loop = soon
        tail = 64  # (the request ring's tail: the broker's)
    os.close(fd)
    try:
        transport.rest = bytearray(b"x" * 100)
        transport.queued = 1
        transport.raw(tail, (1 << 62).to_bytes(8, "little"))
        transport.on_room()
        assert transport.rest == b"" and transport.queued == 0
        ((on_broken, error),) = soon.calls
        assert on_broken == transport.on_broken
        assert type(error) is ShmRingError and "out of bounds" in str(error)
    finally:
        transport.unmap()


def test_a_peer_in_a_pid_namespace_the_broker_cannot_see_stays_on_its_socket(
    broker: BrokerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SO_PEERCRED's pid 0 (every peer of another pid namespace): a group keyed (0, name)
    was joined by any such peer that sent the name, and rode on its wake-ups (reviewshm2
    N6). No rings for such a peer: its connection goes on over its socket."""
    from equeue.server import shm

    monkeypatch.setattr(shm, "peer_pid", lambda sock: 0)

    async def run() -> list[tuple[str, int]]:
        clients = [await equeue.aio.connect(_url(broker), shm=True, timeout=10) for _ in "ab"]
        try:
            return [
                (type(c._protocol.transport).__name__, (await c.send("t", b"x")).queue_offset)  # type: ignore[union-attr]
                for c in clients
            ]
        finally:
            for client in clients:
                await client.close()

    got = asyncio.run(run())
    assert got == [("_SelectorSocketTransport", 0), ("_SelectorSocketTransport", 1)]
    assert broker.broker.shm is not None and not broker.broker.shm.groups
    refusals = [r for r in caplog.records if "pid namespace" in r.message]
    assert len(refusals) == 1 and "SO_PEERCRED pid 0" in refusals[0].message


def test_one_drain_takes_a_64_kib_send_of_wake_up_bytes() -> None:
    """A client's one 64 KiB send on its wake-up end cost the broker 256 drains of 256
    bytes each, every drain a pass over the group's rings (reviewshm2 N2: 2.4 M drains in
    3 s, a broker core ~70 % busy for one client): one drain takes it now."""
    mux = shmrings.ShmMux()
    client_end, broker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with client_end, broker_end:
        broker_end.setblocking(False)
        client_end.sendall(b"w" * 65536)
        mux.drain(broker_end.fileno())
        assert mux.drains == 1
        with pytest.raises(BlockingIOError):
            broker_end.recv(1)
        client_end.sendall(b"w" * 65537)  # (more than a drain takes: the rest waits)
        mux.drain(broker_end.fileno())
        assert broker_end.recv(2) == b"w"
