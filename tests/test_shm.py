"""The shared-memory rings' prototype (equeue serve --shm, equeue.aio.connect(url,
shm=True); docs/benchmarks.md "perfshm (round 15)"): what it does do, each with a real
broker: round trips, a ring smaller than a frame both ways, a peer SIGKILLed mid-frame,
garbage in a ring and an index out of bounds closing that connection only."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_dir
from shm_helpers import RawShm

import equeue.aio
from equeue.client.shmconn import ShmClientTransport
from equeue.protocol import shmrings
from equeue.protocol.frames import FRAME_HEADER, encode
from equeue.server import BrokerThread
from equeue.server.shm import ShmTransport

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")

HERE = Path(__file__).resolve().parent


def _broker(**settings: Any) -> Iterator[BrokerThread]:
    base = short_dir()
    with BrokerThread(base / "store", flush="sync", shm=True, **settings) as thread:
        thread.store.create_topic("t", 1)
        yield thread


@pytest.fixture(name="broker")
def _default_broker() -> Iterator[BrokerThread]:
    yield from _broker()


@pytest.fixture(name="small")
def _small_broker() -> Iterator[BrokerThread]:
    yield from _broker(shm_ring_bytes=4096)


def _url(thread: BrokerThread) -> str:
    return next(u for u in thread.urls if u.startswith("unix:"))


def _on_rings(thread: BrokerThread) -> int:
    return sum(type(c.transport) is ShmTransport for c in list(thread.broker.connections))


async def _round_trips(url: str, connections: int, sends: int) -> list[Any]:
    clients = [await equeue.aio.connect(url, shm=True, timeout=10) for _ in range(connections)]
    try:
        for client in clients:
            assert type(client._protocol.transport) is ShmClientTransport  # type: ignore[union-attr]

        async def lane(client: Any, index: int) -> list[Any]:
            return [await client.send("t", f"{index}-{i}".encode()) for i in range(sends)]

        return list(await asyncio.gather(*(lane(c, i) for i, c in enumerate(clients))))
    finally:
        for client in clients:
            await client.close()


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_round_trips_of_many_connections_on_rings(broker: BrokerThread) -> None:
    results = asyncio.run(_round_trips(_url(broker), 8, 25))
    offsets = sorted(r.queue_offset for lane in results for r in lane)
    assert offsets == list(range(200))
    bodies = {m.body for m in broker.store.pull("t", 0, 0, 500).messages}
    assert bodies == {f"{i}-{j}".encode() for i in range(8) for j in range(25)}
    _wait_for(lambda: not broker.broker.connections, "the connections did not close")
    assert broker.broker.shm is not None and not broker.broker.shm.groups  # wake-ups closed


def test_connections_on_rings_while_they_are_open(broker: BrokerThread) -> None:
    async def run() -> None:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        other = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            await client.send("t", b"a")
            await other.send("t", b"b")
            assert _on_rings(broker) == 2
            # the two connections of one loop are one group: one wake-up socketpair
            assert len(broker.broker.shm.groups) == 1  # type: ignore[union-attr]
            # (two rings: their wake-ups deferred to one a loop turn, each side)
            (group,) = broker.broker.shm.groups.values()  # type: ignore[union-attr]
            assert not group.waker.at_once
            assert not client._protocol.transport.group.waker.at_once  # type: ignore[union-attr]
            got = await client.pull("t", 0, 0, 10)
            assert [m.body for m in got.messages] == [b"a", b"b"]
            assert await other.topics() == ["t"]
        finally:
            await client.close()
            await other.close()

    asyncio.run(run())


def test_a_broker_without_shm_keeps_the_socket() -> None:
    base = short_dir()
    with BrokerThread(base / "store", flush="sync") as thread:
        thread.store.create_topic("t", 1)

        async def run() -> None:
            client = await equeue.aio.connect(_url(thread), shm=True, timeout=10)
            try:
                assert type(client._protocol.transport) is not ShmClientTransport  # type: ignore[union-attr]
                assert (await client.send("t", b"plain")).queue_offset == 0
            finally:
                await client.close()

        asyncio.run(run())


def test_frames_larger_than_the_ring_both_ways(small: BrokerThread) -> None:
    bodies = [bytes([i]) * 1000 for i in range(40)]  # a 40 KB request into a 4 KiB ring

    async def run() -> None:
        client = await equeue.aio.connect(_url(small), shm=True, timeout=10)
        try:
            results = await client.send_batch("t", bodies)
            assert [r.queue_offset for r in results] == list(range(40))
            got = await client.pull("t", 0, 0, 40)  # a 40 KB answer out of one
            assert [m.body for m in got.messages] == bodies
            assert (await client.send("t", b"after")).queue_offset == 40
        finally:
            await client.close()

    asyncio.run(run())
    assert [m.body for m in small.store.pull("t", 0, 0, 50).messages] == [*bodies, b"after"]


def test_a_peer_killed_mid_frame_leaves_the_others_served(broker: BrokerThread) -> None:
    child = subprocess.Popen(
        [sys.executable, str(HERE / "shm_kill_child.py"), _url(broker)[5:]],
        stdout=subprocess.PIPE, text=True, cwd=HERE,
        env=dict(os.environ, PYTHONPATH=f"{HERE.parent}{os.pathsep}{HERE}"),
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
        _wait_for(lambda: broker.broker.partial_bytes > 0, "the half frame was not read")
        assert _on_rings(broker) == 1
        child.send_signal(signal.SIGKILL)
        assert child.wait(20) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(20)
    _wait_for(lambda: not broker.broker.connections, "the killed peer's connection stayed")
    assert broker.broker.partial_bytes == 0
    assert not broker.broker.shm.groups  # type: ignore[union-attr]
    results = asyncio.run(_round_trips(_url(broker), 2, 3))
    assert sorted(r.queue_offset for lane in results for r in lane) == list(range(6))
    assert broker.store.queue_range("t", 0) == (0, 6)  # the half frame stored nothing


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1", id="not-msgpack"),
        pytest.param(encode({"not": "a request"}), id="not-a-request"),
        pytest.param(FRAME_HEADER.pack(0xFFFFFFF0) + b"x", id="too-large"),
    ],
)
def test_garbage_in_a_ring_closes_that_connection_only(
    broker: BrokerThread, garbage: bytes
) -> None:
    async def run() -> None:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            assert (await client.send("t", b"before")).queue_offset == 0
            peer = RawShm(_url(broker)[5:])
            try:
                assert peer.write(garbage) == len(garbage)
                peer.wake()
                assert await asyncio.to_thread(peer.socket_ended)
                # the error answer (request id 0) was put in the answer ring first
                assert peer.read_all()[4:5] == b"\x93"
            finally:
                peer.close()
            assert (await client.send("t", b"after")).queue_offset == 1
        finally:
            await client.close()

    asyncio.run(run())
    assert broker.store.queue_range("t", 0) == (0, 2)


def test_an_index_out_of_bounds_closes_that_connection_only(broker: BrokerThread) -> None:
    async def run() -> None:
        client = await equeue.aio.connect(_url(broker), shm=True, timeout=10)
        try:
            peer = RawShm(_url(broker)[5:])
            try:
                # the request ring's head past its tail by more than the ring holds
                head = (2 * peer.ring_bytes + 1).to_bytes(8, "little")
                peer.ring.raw(shmrings.REQUESTS_HEAD, head)
                peer.wake()
                assert await asyncio.to_thread(peer.socket_ended)
                # refused for the index, before any byte past the ring was taken
                assert b"index is out of bounds" in peer.read_all()
            finally:
                peer.close()
            assert (await client.send("t", b"after")).queue_offset == 0
        finally:
            await client.close()

    asyncio.run(run())


def test_a_drain_cut_short_after_its_passes_comes_back() -> None:
    """Rings that keep the reader busy for its 4 passes, while a third ring's producer
    publishes (and, finding the reader awake, sends no wake-up): the drain, even one
    not started by a wake-up (drain(-1)), schedules itself again, or the third ring's
    request waits until its client publishes again (reviewshm F4)."""
    total = shmrings.region_bytes(4096)
    efd = -1  # (the wake-ups sent: none needed here)
    pairs = []
    for _ in range(3):
        fd = os.memfd_create("t", os.MFD_CLOEXEC)
        os.ftruncate(fd, total)
        client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
        client.waker = shmrings.ShmWaker(efd, lambda fire: fire())
        pairs.append((client, shmrings.ShmRing(fd, total, shmrings.BROKER)))
        os.close(fd)
    (x_client, x_broker), (y_client, y_broker), (z_client, z_broker) = pairs

    class Reader:
        def __init__(self, on_read: Any) -> None:
            self.buffer = bytearray(1 << 16)
            self.reads = 0
            self.on_read = on_read

        def get_buffer(self, hint: int) -> memoryview:
            return memoryview(self.buffer)

        def buffer_updated(self, n: int) -> None:
            self.reads += 1
            self.on_read(self.reads)

    y_broker.protocol = Reader(lambda reads: z_client.put(b"z" * 10))
    z_broker.protocol = Reader(
        lambda reads: y_client.put(b"y" * 10) if reads < 4 else x_client.put(b"request of X")
    )
    x_broker.protocol = Reader(lambda reads: None)
    mux = shmrings.ShmMux()
    scheduled: list[tuple[Any, ...]] = []
    mux.again = lambda *call: scheduled.append(call)  # (loop.call_soon)
    for ring in (x_broker, y_broker, z_broker):
        mux.add(ring)
    y_client.put(b"y" * 10)
    mux.drain(-1)
    assert z_broker.protocol.reads == 4  # (the scenario: cut short after 4 passes)
    assert x_broker.protocol.reads == 0  # (X published during the drain: not read)
    assert scheduled == [(mux.drain, -2)]  # (the reader comes back for X: -2, "again")
    mux.drain(-2)
    assert x_broker.protocol.reads == 1


def _mux(*rings: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    """A group's reader over ``rings``, and the calls it schedules (its loop.call_soon)."""
    mux = shmrings.ShmMux()
    scheduled: list[tuple[Any, ...]] = []
    mux.again = lambda *call: scheduled.append(call)
    for ring in rings:
        mux.add(ring)
    return mux, scheduled


def _frames(data: bytes) -> list[bytes]:
    frames, at = [], 0
    while at + 4 <= len(data):
        (length,) = FRAME_HEADER.unpack_from(data, at)
        frames.append(data[at + 4 : at + 4 + length])
        at += 4 + length
    assert at == len(data), "a frame cut short"
    return frames


def _answers_until_the_end(peer: RawShm) -> bytes:
    """Everything the answer ring gets until the broker ends the socket (each read
    makes room: the broker is woken for what waited for it), bounded by TIMEOUT_S."""
    got = bytearray()
    deadline = time.monotonic() + 20
    peer.sock.setblocking(False)
    while time.monotonic() < deadline:
        got += peer.read_all()
        try:
            if peer.sock.recv(1) == b"":
                return bytes(got + peer.read_all())
        except BlockingIOError:
            time.sleep(0.005)
    raise AssertionError(f"the socket did not end ({len(got)} bytes of answers)")


def test_a_half_closed_client_gets_the_answers_of_what_its_ring_held(broker: BrokerThread) -> None:
    """Requests in the ring, the broker woken, and the socket's write side shut at once:
    every request is read and answered before the broker closes, as on a socket
    (reviewshm F6: the end closed the connection with the requests unread)."""
    peer = RawShm(_url(broker)[5:])
    try:
        sends = b"".join(
            encode([i + 1, "send", {"topic": "t", "body": b"%d" % i}]) for i in range(10)
        )
        assert peer.write(sends) == len(sends)
        peer.wake()
        peer.sock.shutdown(socket.SHUT_WR)
        answers = _frames(_answers_until_the_end(peer))
    finally:
        peer.close()
    assert len(answers) == 10
    assert broker.store.queue_range("t", 0) == (0, 10)


def test_a_closed_connection_writes_the_answers_waiting_for_room_first(small: BrokerThread) -> None:
    """A 10 KB answer through a 4 KiB ring, the client half-closed: the broker's close
    (after its last answer) waits until the answer is all in the ring, as asyncio's close
    flushes its buffer (reviewshm F8: the client got 4,096 bytes and the socket's end)."""
    small.store.send_batch("t", [bytes([i]) * 1000 for i in range(10)])
    peer = RawShm(_url(small)[5:])
    try:
        pull = encode([1, "pull", {"topic": "t", "queue_id": 0, "offset": 0}])
        assert peer.write(pull) == len(pull)
        peer.wake()
        peer.sock.shutdown(socket.SHUT_WR)
        answers = _frames(_answers_until_the_end(peer))
    finally:
        peer.close()
    assert len(answers) == 1 and len(answers[0]) > 10_000


@pytest.mark.parametrize("at_once", [True, False])
def test_a_group_of_one_ring_is_woken_at_once_and_a_larger_one_once_a_loop_turn(
    at_once: bool,
) -> None:
    """A producer that finds the reader asleep: with one ring in the group the wake-up
    byte is sent at once (no loop turn for it, reviewshm F10); with more, one call_soon
    per loop turn sends one byte however many rings noted it."""
    total = shmrings.region_bytes(4096)
    ours, peers = socket.socketpair()
    scheduled: list[Any] = []
    waker = shmrings.ShmWaker(ours.fileno(), scheduled.append)
    waker.at_once = at_once
    rings = []
    for _ in range(3):
        fd = os.memfd_create("t", os.MFD_CLOEXEC)
        os.ftruncate(fd, total)
        client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
        client.waker = waker
        broker = shmrings.ShmRing(fd, total, shmrings.BROKER)
        broker.set_reader_sleeps(True)
        rings.append((client, broker))
        os.close(fd)
    try:
        peers.setblocking(False)
        for client, _ in rings:
            assert client.put(b"request") == 7
        if at_once:
            assert scheduled == [] and peers.recv(16) == b"\x01" * 3
        else:
            with pytest.raises(BlockingIOError):
                peers.recv(16)
            assert len(scheduled) == 1
            scheduled[0]()
            assert peers.recv(16) == b"\x01"
    finally:
        ours.close()
        peers.close()


def test_stats_count_the_connections_on_rings(broker: BrokerThread) -> None:
    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        clients = [await equeue.aio.connect(_url(broker), shm=True, timeout=10) for _ in range(2)]
        plain = await equeue.aio.connect(_url(broker), timeout=10)
        try:
            await clients[0].send("t", b"a")
            during = (await plain.stats())["shm"]
        finally:
            for client in clients:
                await client.close()
        _wait_for(lambda: not broker.broker.shm.groups, "the group stayed")  # type: ignore[union-attr]
        try:
            after = (await plain.stats())["shm"]
        finally:
            await plain.close()
        return during, after

    during, after = asyncio.run(run())
    total = shmrings.region_bytes(shmrings.DEFAULT_RING_BYTES)
    assert during["connections"] == 2 and during["groups"] == 1
    assert during["ring_bytes"] == shmrings.DEFAULT_RING_BYTES
    assert during["mapped_bytes"] == 2 * total
    assert during["drains"] >= 1  # (the send's request was read by the group's reader)
    assert after["connections"] == 0 and after["groups"] == 0 and after["mapped_bytes"] == 0
    assert after["drains"] >= during["drains"]


def test_a_flooded_ring_yields_the_loop_after_a_socket_reads_worth() -> None:
    """A producer that refills its ring as fast as the broker reads it: a drain read the
    ring until empty, up to 64 reads, and one producer held the broker's loop 100-116 ms
    a drain, every other client waiting (reviewshm2 N10). A drain takes 256 KiB (a socket
    read's worth), comes back once a turn (not once per cut drain, plus the wake-up's
    reader beside it), and starts at the ring after the one that used its budget."""
    ring_bytes = 1 << 16
    total = shmrings.region_bytes(ring_bytes)
    pairs = []
    for _ in range(2):
        fd = os.memfd_create("t", os.MFD_CLOEXEC)
        os.ftruncate(fd, total)
        client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
        client.waker = shmrings.ShmWaker(-1, lambda fire: fire())
        pairs.append((client, shmrings.ShmRing(fd, total, shmrings.BROKER)))
        os.close(fd)
    (flood_client, flood_broker), (other_client, other_broker) = pairs

    class Reader:
        def __init__(self, refill: Any) -> None:
            self.buffer = bytearray(ring_bytes)
            self.taken = 0
            self.refill = refill

        def get_buffer(self, hint: int) -> memoryview:
            return memoryview(self.buffer)

        def buffer_updated(self, n: int) -> None:
            self.taken += n
            self.refill()

    flood_broker.protocol = Reader(lambda: flood_client.put(b"f" * ring_bytes))
    other_broker.protocol = Reader(lambda: None)
    mux, scheduled = _mux(flood_broker, other_broker)
    flood_client.put(b"f" * ring_bytes)
    other_client.put(b"request")
    wake_end, broker_end = socket.socketpair()
    with wake_end, broker_end:
        broker_end.setblocking(False)
        wake_end.send(b"w")
        mux.drain(broker_end.fileno())  # (the wake-up's reader)
        assert flood_broker.protocol.taken == 4 * ring_bytes  # (was 64 reads: 4 MiB here)
        assert other_broker.protocol.taken == 0
        assert scheduled == [(mux.drain, -2)] and mux.cut == 1
        wake_end.send(b"w")
        mux.drain(broker_end.fileno())  # (again: the scheduled drain reads, not this one)
        assert flood_broker.protocol.taken == 4 * ring_bytes
        mux.schedule()  # (a connection's reading resumed: the one scheduled drain)
        assert len(scheduled) == 1
    mux.drain(-2)  # (the loop's next turn: the other ring first)
    assert other_broker.protocol.taken == len(b"request")
    assert flood_broker.protocol.taken == 8 * ring_bytes  # (a read past the budget: 7 bytes over)
    assert len(scheduled) == 2
    # drain(-1) in place takes its budget too: a connection's end reads its own ring
    # with drain_ring (review9 R9-2: a half-close's drain(-1) read the flood unbudgeted)
    taken = flood_broker.protocol.taken
    mux.drain(-1)
    assert flood_broker.protocol.taken - taken == 4 * ring_bytes
