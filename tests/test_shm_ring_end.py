"""A connection's end on shared rings (a client's half-close at the broker, the broker's
socket end at the client): what its peer published before the end is all read, and none
of the group's other rings is read with it (review9 R9-2: the end's unbudgeted drain(-1)
read every ring of the group, a flooding ring 16 reads x 4 passes at each half-close)."""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any, ClassVar

import msgpack
import pytest
from server_helpers import short_dir
from shm_helpers import RawShm
from test_shm import _answers_until_the_end, _broker, _frames, _mux, _url

from equeue.errors import ShmRingError
from equeue.protocol import shmrings
from equeue.protocol.frames import FRAME_HEADER, encode
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")

DEADLINE_S = 20.0


@pytest.fixture(name="broker")
def _default_broker() -> Any:
    yield from _broker()


class _Reader:
    """A ring's protocol that takes whole reads and, while ``refills`` lasts, puts as
    much again in its ring (a producer as fast as the reader)."""

    def __init__(self, size: int, refill: Any, refills: int) -> None:
        self.buffer = bytearray(size)
        self.taken = 0
        self.refill = refill
        self.refills = refills

    def get_buffer(self, hint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, n: int) -> None:
        self.taken += n
        if self.refills > 0:
            self.refills -= 1
            self.refill()


def _pair(ring_bytes: int, broker_ring: Any = shmrings.ShmRing) -> tuple[Any, Any]:
    total = shmrings.region_bytes(ring_bytes)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
        client.waker = shmrings.ShmWaker(-1, lambda fire: fire())  # (no wake-ups needed)
        return client, broker_ring(fd, total, shmrings.BROKER)
    finally:
        os.close(fd)


def test_drain_ring_reads_that_ring_past_a_budget_and_no_other() -> None:
    """Ring A refilled on every read (the N10 flood), ring B holding 1 MiB before its
    end, more than a drain's budget (256 KiB) and 16 reads of 64 KiB: drain_ring(B) takes
    all of B and nothing of A; a B that keeps refilling (a hostile peer writing after its
    end) gets what it had published when drain_ring began, and nothing after."""
    ring_bytes = 1 << 20
    (a_client, a_broker), (b_client, b_broker) = _pair(ring_bytes), _pair(ring_bytes)
    a_broker.protocol = _Reader(1 << 16, lambda: a_client.put(b"a" * (1 << 16)), 1 << 30)
    b_broker.protocol = _Reader(1 << 16, lambda: None, 0)
    mux, scheduled = _mux(a_broker, b_broker)
    a_client.put(b"a" * (1 << 16))
    b_client.put(b"b" * ring_bytes)
    mux.drain_ring(b_broker)
    assert b_broker.protocol.taken == ring_bytes  # (16 reads: past one budget)
    assert a_broker.protocol.taken == 0
    assert scheduled == [] and mux.drains == 0 and mux.ring_drains == 1
    # the group's own drain still takes A, a budget's worth
    mux.drain(-1)
    assert a_broker.protocol.taken == 4 << 16
    # a B that refills for ever: what was there when the drain began (was: 64 reads)
    b_broker.protocol = _Reader(1 << 16, lambda: b_client.put(b"b" * (1 << 16)), 1 << 30)
    b_client.put(b"b" * (1 << 17))
    mux.drain_ring(b_broker)
    assert b_broker.protocol.taken == 1 << 17
    assert b_client.room() == ring_bytes - (2 << 16)  # (its two refills wait in the ring)
    with pytest.raises(TypeError, match="takes a ShmRing"):
        mux.drain_ring(object())


def test_drain_ring_reads_a_ring_over_64_reads_whole() -> None:
    """review10 F5: drain_ring stopped at 4 passes x 16 reads (16 MiB of the broker's
    256 KiB reads; a ring may be 1 GiB), so a half-close dropped the rest of a big ring
    and blamed the client for a frame cut short. Here 8 MiB in 32 KiB reads: 256 reads."""
    ring_bytes = 8 << 20
    client, broker = _pair(ring_bytes)
    broker.protocol = _Reader(1 << 15, lambda: None, 0)
    mux, _ = _mux(broker)
    assert client.put(b"c" * ring_bytes) == ring_bytes
    mux.drain_ring(broker)
    assert broker.protocol.taken == ring_bytes  # (was: 64 reads, 2 MiB)
    assert client.room() == ring_bytes


class _Breakable(shmrings.ShmRing if shmrings.AVAILABLE else object):  # type: ignore[misc]
    """The broker's ring, keeping what its transport's on_broken is given (ShmTransport
    closes its connection then) in ``errors`` (the C type's subclasses have no __dict__)."""

    errors: ClassVar[list[BaseException]] = []

    def on_broken(self, error: BaseException) -> None:
        self.errors.append(error)


class _Racing(_Reader):
    """A hostile peer's ring: its head holds garbage when drain_ring loads its bound and
    a valid head at every read after it (published in get_buffer, between the broker's
    loads, as a peer racing from its own process would), refilled as fast as read."""

    def __init__(self, publish: Any, refills: int) -> None:
        super().__init__(1 << 16, publish, refills)
        self.first = True

    def get_buffer(self, hint: int) -> memoryview:
        if self.first:
            self.first = False
            self.refill()
        return super().get_buffer(hint)


def test_drain_ring_breaks_a_ring_whose_head_is_out_of_bounds_when_it_begins() -> None:
    """review11 R11-5: drain_ring took the peer's head as its bound unchecked, and each
    read re-checks only the head it loads: garbage at the first load and valid heads
    after kept the broker's loop in one drain_ring for as long as the peer refilled
    (here 4,096 refills of 64 KiB: 256 MiB, 256 of its 1 MiB rings). Now that head breaks
    the ring, as a read's does, before anything is read; the group's other ring is read
    as before."""
    ring_bytes = 1 << 20
    (client, broker), (b_client, b_broker) = _pair(ring_bytes, _Breakable), _pair(ring_bytes)
    broker.protocol = _Racing(lambda: client.put(b"h" * (1 << 16)), 4096)
    b_broker.protocol = _Reader(1 << 16, lambda: None, 0)
    mux, _ = _mux(broker, b_broker)
    broker.errors.clear()
    b_client.put(b"b" * (1 << 16))
    client.raw(shmrings.REQUESTS_HEAD, (1 << 62).to_bytes(8, "little"))
    mux.drain_ring(broker)
    assert broker.protocol.taken == 0  # (was: 268,435,456 bytes in that one call)
    assert broker.broken == 1
    [error] = broker.errors
    assert isinstance(error, ShmRingError) and "head index is out of bounds" in str(error)
    mux.drain_ring(broker)  # a broken ring is read no more
    assert broker.protocol.taken == 0 and broker.errors == [error]
    mux.drain(-1)
    assert b_broker.protocol.taken == 1 << 16 and broker.protocol.taken == 0


def _sends(first_id: int, count: int, body: bytes) -> bytes:
    return b"".join(
        encode([first_id + i, "send", {"topic": "t", "body": body}]) for i in range(count)
    )


def test_a_half_close_reads_its_own_ring_and_not_the_groups_others(broker: BrokerThread) -> None:
    """Two raw connections of one group, each publishing without a wake-up: A 200 sends,
    B one send and then its half-close. The broker's read at B's end answers B's send
    and leaves A's requests where they are (it read them all, in place, before); A's
    wake-up then has the group's drain read them."""
    path = _url(broker)[5:]
    group = secrets.token_hex(8)
    quiet, closing = RawShm(path, group), RawShm(path, group)
    try:
        for peer in (quiet, closing):  # (publish only: no wake-up byte on the group's socket)
            peer.ring.waker = shmrings.ShmWaker(-1, lambda fire: fire())
        waiting = _sends(1, 200, b"q" * 100)
        assert quiet.write(waiting) == len(waiting)
        room = quiet.ring.room()
        assert room == quiet.ring_bytes - len(waiting)
        last = _sends(1, 1, b"closing")
        assert closing.write(last) == len(last)
        closing.sock.shutdown(socket.SHUT_WR)
        answers = _frames(_answers_until_the_end(closing))
        assert len(answers) == 1
        assert quiet.ring.room() == room  # (was: the ring read empty, 200 sends stored)
        assert broker.store.queue_range("t", 0) == (0, 1)
        quiet.wake()
        deadline = time.monotonic() + DEADLINE_S
        got = b""
        while len(_complete(got)) < 200 and time.monotonic() < deadline:
            got += quiet.read_all()
            time.sleep(0.005)
        assert len(_complete(got)) == 200
        assert broker.store.queue_range("t", 0) == (0, 201)
    finally:
        quiet.close()
        closing.close()


def test_a_half_close_while_reading_is_paused_answers_every_request_before_it() -> None:
    """review10 F2: the answers back up (write_buffer_high 1 MiB, 100 KB each) and the
    connection pauses its reading with requests left in the ring; the half-close then
    read nothing (deliver stops at a paused ring) and the connection ended after the
    answers of what it had read: 40 of 50. A socket delivers its EOF after its last byte:
    so does the ring now, once the connection resumes reading."""
    with BrokerThread(
        short_dir() / "store", flush="async", shm=True, write_buffer_high=1 << 20
    ) as thread:
        thread.store.create_topic("t", 1)
        thread.store.send("t", b"B" * 100_000)
        peer = RawShm(_url(thread)[5:])
        try:
            first = b"".join(_pull(i) for i in range(1, 41))
            assert peer.write(first) == len(first)
            peer.wake()
            deadline = time.monotonic() + DEADLINE_S
            while not _paused(thread) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _paused(thread), "the connection never paused its reading"
            later = b"".join(_pull(i) for i in range(41, 51))
            assert peer.write(later) == len(later)
            peer.wake()
            peer.sock.shutdown(socket.SHUT_WR)
            answers = _frames(_answers_until_the_end(peer))
            ids = sorted(msgpack.unpackb(a, raw=False, strict_map_key=False)[0] for a in answers)
            assert ids == list(range(1, 51))  # (was: 1..40)
        finally:
            peer.close()


def _pull(request_id: int) -> bytes:
    return encode([request_id, "pull", {"topic": "t", "queue_id": 0, "offset": 0, "max_count": 1}])


def _paused(thread: BrokerThread) -> bool:
    conns = list(thread.broker.connections)
    # (getattr: the connection is on its socket's transport until the rings are set up)
    paused = bool(conns) and getattr(conns[0].transport, "paused", 0) == 1
    return paused and bool(conns[0]._backlog)


def _complete(data: bytes) -> list[bytes]:
    """The whole frames at the start of ``data`` (answers still arriving)."""
    frames, at = [], 0
    while at + 4 <= len(data):
        (length,) = FRAME_HEADER.unpack_from(data, at)
        if at + 4 + length > len(data):
            break
        frames.append(data[at + 4 : at + 4 + length])
        at += 4 + length
    return frames
